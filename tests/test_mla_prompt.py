"""MLA prompts: a long segment attends with each head's keys and values expanded from the
cached latents by kv_b (`LatentAttention.expanded`) rather than in the latent space: the same
attention in fewer multiply-adds, whatever the heads' grouping."""

import numpy as np
import pytest

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import write_checkpoint


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32"])  # deepseek_v32: the indexer's chosen positions too
def test_an_expanded_prompt_attends_as_the_latent_space_does(tmp_path, monkeypatch, arch):
    from colibri.runtime import model as model_module
    from colibri.runtime import open_model

    convert(str(write_checkpoint(tmp_path / "src", arch)), tmp_path / "model", ConvertOptions(quant="F32", progress=False))
    model = open_model(tmp_path / "model", ctx=128)
    ids = np.random.default_rng(5).integers(3, model.config.vocab_size, model_module.EXPANDED_MLA_QUERIES + 30).tolist()
    calls = []
    expanded_attention = model_module.LatentAttention.expanded
    monkeypatch.setattr(model_module.LatentAttention, "expanded",
                        lambda self, *args: calls.append(self.layer) or expanded_attention(self, *args))
    expanded = model.prefill(ids)
    assert sorted(set(calls)) == list(range(model.config.n_layers))

    monkeypatch.setattr(model_module, "EXPANDED_MLA_BYTES", 1)  # one head at a time
    model.reset()
    assert np.array_equal(model.prefill(ids), expanded)

    monkeypatch.setattr(model_module, "EXPANDED_MLA_QUERIES", 10**9)  # every row in the latent space
    model.reset()
    latent = model.prefill(ids)
    assert np.abs(expanded - latent).max() <= 1e-4 * np.abs(latent).max()
    assert (expanded.argmax(axis=1) == latent.argmax(axis=1)).all()
