import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOY_MODEL = ROOT / "examples" / "toy" / "model"

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def toy_weights(tmp_path_factory) -> Path:
    """The toy model with fixed random weights, saved once per session."""
    import torch
    from transformers import AutoModelForCausalLM

    from dsrl.tasks.toy import build_model_config, build_tokenizer

    out = tmp_path_factory.mktemp("toy_weights")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_model_config()).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out
