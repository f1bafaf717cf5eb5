"""The KV cache's storage kinds on MLA, whose one stream per layer holds the latent and then the
shared rotary key (read in place by the attention kernel when f16): f16 and q8_0 give the f32
cache's logits up to their rounding, for a prompt and for the tokens decoded after it. (On
this random-weight model q8_0's worst logit is off by most of a standard deviation, as it
was with the two streams stored apart.)"""

import numpy as np
import pytest

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import write_checkpoint
from colibri.runtime import open_model

TOLERANCE = {"f16": 0.03, "q8_0": 0.1}  # mean error, of the f32 logits' standard deviation


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    convert(str(write_checkpoint(root / "src", "deepseek_v3")), root / "model", ConvertOptions(quant="Q8_0", progress=False))
    return root / "model"


def logits(path, kv_quant, ids):
    model = open_model(path, ctx=64, kv_quant=kv_quant, ram_budget="8G")
    out = [model.prefill(ids[:12])]
    out += [model.decode(t)[None] for t in ids[12:]]
    return np.concatenate(out)


@pytest.mark.parametrize("kv_quant", sorted(TOLERANCE))
def test_mla_cache_kinds_agree_with_f32(mla_model, kv_quant):
    ids = np.random.default_rng(3).integers(0, 500, 20).tolist()
    want, got = logits(mla_model, "f32", ids), logits(mla_model, kv_quant, ids)
    assert np.abs(got - want).mean() <= TOLERANCE[kv_quant] * want.std()
