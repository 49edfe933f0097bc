"""Built-in tasks: the toy task (`toy.py`) and the calculator agent (`calculator.py`)."""
