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


@pytest.fixture(scope="module")
def quantized_mla(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla-q4km")
    convert(str(write_checkpoint(root / "src", "deepseek_v3")), root / "model", ConvertOptions(quant="Q4_K_M", progress=False))
    return root / "model"


def continued_prefill(path, ids, cuts, keep_bytes, monkeypatch):
    """Logits of prefilling `ids` in pieces ending at `cuts` on one cache, with `keep_bytes` for
    the kept expansions; and for each expanded cut, (the positions kept before it, its end)."""
    from colibri.runtime import kept_expansions
    from colibri.runtime import model as model_module
    from colibri.runtime import open_model

    monkeypatch.setattr(model_module, "EXPANDED_MLA_KEEP_BYTES", keep_bytes)
    model = open_model(path, ctx=320)
    spans = []
    expand = kept_expansions.expand

    def watched(cache, layer, latents, *args):
        kept = cache.expansions.get(layer)
        spans.append((0 if kept is None else kept.upto, latents.shape[0]))
        return expand(cache, layer, latents, *args)

    monkeypatch.setattr(kept_expansions, "expand", watched)
    logits = np.concatenate([model.prefill(ids[a:b]) for a, b in zip((0, *cuts), cuts)])
    used, layers = model.decoder.layers[0][1].budget.used, model.config.n_layers
    model.close()
    return logits, spans, used, layers


def test_a_prompts_later_cuts_expand_only_their_own_positions_to_the_same_bits(quantized_mla, monkeypatch):
    """Cuts ending at 100 (not a multiple of the int8 product's row group), 170 and 270: each
    expands from where the last left off, and the logits are those of expanding everything
    again each cut (no budget)."""
    ids = np.random.default_rng(7).integers(3, 512, 270).tolist()
    cuts = (100, 170, 270)
    kept, spans, used, layers = continued_prefill(quantized_mla, ids, cuts, 256 << 20, monkeypatch)
    assert spans == [(0, 100)] * layers + [(100, 170)] * layers + [(170, 270)] * layers
    assert used > 0  # (kept after the last cut until a decoded token or a write below it)
    again, spans, used, _ = continued_prefill(quantized_mla, ids, cuts, 0, monkeypatch)
    assert used == 0 and np.array_equal(kept, again)
