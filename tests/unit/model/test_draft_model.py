"""The draft network: exported names, initialisation, masked slots, RoPE positions, SDPA == flex."""

from __future__ import annotations

import math

import pytest
import torch

from peagle.builtin import build_tiny_llama
from peagle.cod.rows import block_mask_for, build_flat_row, mask_for
from peagle.cod.sampling import sample_cod
from peagle.model.attention import select_attention
from peagle.model.draft import DraftConfig, PEagleDraft, expected_state_keys
from peagle.model.initialization import init_from_target

V, VD, H = 256, 64, 32


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return build_tiny_llama(vocab_size=V, hidden_size=H, num_heads=4, num_kv_heads=2, num_layers=2, seed=1)


def _draft(target: torch.nn.Module, layers: int = 3, vd: int = VD) -> tuple[PEagleDraft, torch.Tensor | None]:
    cfg = DraftConfig.from_target(target.config, num_layers=layers, draft_vocab_size=vd, mask_token_id=7,
                                  aux_layer_ids=[0, 1, 1])
    torch.manual_seed(0)
    draft = PEagleDraft(cfg)
    t2d = None
    if vd < V:
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[torch.randperm(V)[:vd]] = True
    init_from_target(draft, target, t2d)
    return draft, t2d


def test_parameter_names_are_the_exported_keys(target: torch.nn.Module) -> None:
    draft, _ = _draft(target)
    assert sorted(draft.state_dict()) == expected_state_keys(3, compressed_vocab=True)
    assert "layers.0.hidden_norm.weight" in expected_state_keys(3, compressed_vocab=True)
    assert "layers.1.hidden_norm.weight" not in draft.state_dict()
    full, _ = _draft(target, layers=1, vd=V)
    assert sorted(full.state_dict()) == expected_state_keys(1, compressed_vocab=False)
    sd = draft.state_dict()
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (32, 2 * H)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (16, 2 * H)
    assert sd["layers.1.self_attn.q_proj.weight"].shape == (32, H)
    assert sd["fc.weight"].shape == (H, 3 * H) and sd["mask_hidden"].shape == (1, 1, 3 * H)
    assert sd["lm_head.weight"].shape == (VD, H) and sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert 0.5 < float(sd["mask_hidden"].std()) < 1.5  # N(0, 1), not 0.02


def test_unloaded_weights_are_nan_and_init_copies_target_rows(target: torch.nn.Module) -> None:
    cfg = DraftConfig.from_target(target.config, num_layers=1, draft_vocab_size=VD, mask_token_id=7,
                                  aux_layer_ids=[0, 1, 1])
    fresh = PEagleDraft(cfg)
    assert torch.isnan(fresh.embed_tokens.weight).all() and torch.isnan(fresh.lm_head.weight).all()
    draft, t2d = _draft(target)
    ids = torch.nonzero(t2d).flatten()
    assert torch.equal(draft.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(draft.lm_head.weight, target.get_output_embeddings().weight[ids])
    assert torch.equal(draft.draft_to_target(torch.arange(VD)), ids)


def _flat(seed: int = 0, t: int = 24) -> tuple:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (t,), generator=g)
    lm = (torch.rand(t, generator=g) < 0.8).long()
    doc = torch.zeros(t, dtype=torch.long)
    doc[t // 2 :] = 1
    doc[-2:] = -1
    anchor, depth = sample_cod(lm, 4, 0.8, 0.3, document_ids=doc, generator=g)
    row = build_flat_row(ids, lm, doc, anchor, depth, 7)
    aux = torch.randn(t, 3 * H, generator=g)[row.ref_pos]
    return row, aux


def test_masked_slots_ignore_token_and_aux(target: torch.nn.Module) -> None:
    draft, _ = _draft(target)
    row, aux = _flat()
    mask = mask_for(row)
    args = (row.is_masked[None], row.ref_pos[None], mask)
    h1 = draft(row.input_ids[None], aux[None], *args)
    noisy_ids = torch.where(row.is_masked, 11, row.input_ids)
    noisy_aux = torch.where(row.is_masked[:, None], torch.randn_like(aux), aux)
    h2 = draft(noisy_ids[None], noisy_aux[None], *args)
    assert torch.isfinite(h1).all() and h1.shape == (1, row.num_elements, H)
    torch.testing.assert_close(h1, h2, rtol=0, atol=0)
    # RoPE follows the given positions: shifting all positions by a constant changes nothing (relative),
    # scrambling them does.
    h3 = draft(row.input_ids[None], aux[None], row.is_masked[None], row.ref_pos[None] + 5, mask)
    torch.testing.assert_close(h1, h3, rtol=1e-4, atol=1e-5)
    h4 = draft(row.input_ids[None], aux[None], row.is_masked[None], row.ref_pos.flip(0)[None], mask)
    assert not torch.allclose(h1, h4, atol=1e-4)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_sdpa_and_flex_paths_agree(target: torch.nn.Module) -> None:
    draft, _ = _draft(target)
    row, aux = _flat(seed=3)
    real = row.doc >= 0  # padding rows differ by design (self-key vs empty) and carry no weight
    with torch.no_grad():
        dense = draft(row.input_ids[None], aux[None], row.is_masked[None], row.ref_pos[None], mask_for(row))
        flex = draft(row.input_ids[None], aux[None], row.is_masked[None], row.ref_pos[None], block_mask_for(row))
    torch.testing.assert_close(dense[0, real], flex[0, real], rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_carried_context_keys_give_the_same_hidden_states(target: torch.nn.Module) -> None:
    """A segment's owned elements attending to its depth-0 context through carried keys / values
    (`KVCarry`: one no-grad pass over the depth-0 prefix) equal the forward over [context ; owned],
    with the dense (rectangular) mask and with flex (`block_mask_for(query_offset=...)`)."""
    from peagle.cod.rows import plan_segments, segment_row, subset_row
    from peagle.model.attention import KVCarry

    draft, _ = _draft(target)
    row, aux = _flat(seed=3, t=32)
    seg = plan_segments(row, 32, 3)[2]
    sub = segment_row(row, seg)
    nc = int((~seg.owned).sum())
    assert nc > 0 and not bool(seg.owned[:nc].any())
    sub_aux = aux[seg.index]
    own = torch.arange(nc, sub.num_elements)
    with torch.no_grad():
        full = draft(sub.input_ids[None], sub_aux[None], sub.is_masked[None], sub.ref_pos[None], mask_for(sub))
        d0 = torch.nonzero(row.depth == 0).reshape(-1)
        ctx = subset_row(row, d0)
        keys: list = []
        draft(ctx.input_ids[None], aux[d0][None], ctx.is_masked[None], ctx.ref_pos[None], mask_for(ctx),
              kv=KVCarry(capture=keys))
        assert len(keys) == 3 and keys[0][0].shape == (1, 2, 32, H // 4)
        past = [(k[:, :, :nc], v[:, :, :nc]) for k, v in keys]
        o = subset_row(sub, own)
        args = (o.input_ids[None], sub_aux[own][None], o.is_masked[None], o.ref_pos[None])
        dense = draft(*args, mask_for(sub)[nc:], kv=KVCarry(past=past))
        flex = draft(*args, block_mask_for(sub, query_offset=nc), kv=KVCarry(past=past))
    real = o.doc >= 0  # padding queries: self-key (dense) vs empty (flex) by design
    torch.testing.assert_close(dense[0], full[0, nc:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(flex[0, real], full[0, nc:][real], rtol=1e-4, atol=1e-5)


def test_attention_selection() -> None:
    assert select_attention("cpu") == "sdpa" and select_attention("cuda") == "flex"
    assert select_attention("cuda", "sdpa") == "sdpa"
    with pytest.raises(ValueError, match=r"resources\.attention"):
        select_attention("cpu", "xformers")


def test_config_round_trip_and_validation(target: torch.nn.Module) -> None:
    cfg = DraftConfig.from_target(target.config, num_layers=2, draft_vocab_size=None, mask_token_id=5,
                                  aux_layer_ids=[0, 1, 1])
    assert cfg.draft_vocab_size == V and DraftConfig(**cfg.to_dict()) == cfg
    assert cfg.llama_config().num_hidden_layers == 2 and cfg.head_dim == 8
    assert math.isclose(cfg.rope_parameters["rope_theta"], 100000.0)
    with pytest.raises(ValueError, match="mask_token_id"):
        DraftConfig(**{**cfg.to_dict(), "mask_token_id": V})


def test_query_groups_equal_one_dense_sdpa_call() -> None:
    import torch.nn.functional as F

    from peagle.cod.mask import additive_mask
    from peagle.model.attention import QueryGroups, attend, group_queries

    row, _ = _flat(seed=5, t=256)  # two documents + padding, K = 4: N well above GROUP_MIN_ELEMENTS
    n = row.num_elements
    bool_mask = mask_for(row)  # [N, N]
    assert group_queries(bool_mask[:100, :100], row.ref_pos[:100]) is None  # too short to group
    g = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.randn(1, h, n, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    for mask in (bool_mask, additive_mask(bool_mask, torch.float64)):
        groups = group_queries(mask, row.ref_pos, group_size=64)
        assert isinstance(groups, QueryGroups) and len(groups.groups) == -(-n // 64)
        work = sum(qi.numel() * ki.numel() for qi, ki, _ in groups.groups)
        assert work < 0.8 * n * n  # keys nobody in a group sees are left out
        assert torch.equal(torch.cat([qi for qi, _, _ in groups.groups]).sort().values, torch.arange(n))
        outs, grads = [], []
        for m in (mask, groups):
            q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
            out = attend(q, k, v, m) if m is groups else F.scaled_dot_product_attention(
                q, k, v, attn_mask=m, enable_gqa=True
            )
            (out * torch.linspace(-1, 1, n, dtype=torch.float64)[:, None]).sum().backward()
            outs.append(out)
            grads.append([q.grad, k.grad, v.grad])
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=1e-12)
        for a, b in zip(grads[1], grads[0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_draft_gives_the_same_hidden_for_bool_additive_and_grouped_masks(
    target: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    import peagle.model.attention as attention_mod
    from peagle.cod.mask import additive_mask
    from peagle.model.attention import DenseMask, group_queries

    draft, _ = _draft(target)
    row, aux = _flat(seed=6, t=256)
    args = (row.input_ids[None], aux[None], row.is_masked[None], row.ref_pos[None])
    bool_mask = mask_for(row)
    add = additive_mask(bool_mask)
    groups = group_queries(add, row.ref_pos, group_size=64)
    assert groups is not None
    with torch.no_grad():
        prefixed = DenseMask.split(add, row.is_masked[None])
        assert 0 < prefixed.prefix < row.num_elements  # the depth-0 block as its own SDPA call
        outs = [draft(*args, m) for m in (bool_mask, bool_mask[None], add, groups, prefixed)]  # used as given
        monkeypatch.setattr(attention_mod, "GROUP_MIN_ELEMENTS", 10**9)
        assert group_queries(add, row.ref_pos) is None
        ref = draft(*args, bool_mask)  # one dense call
    for out in outs:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_projections_are_module_calls(target: torch.nn.Module) -> None:
    """Every projection runs through its module, so forward hooks (and DDP / LoRA-style wrappers) see it:
    the hooks fire, and an output a hook returns is the one the draft goes on with."""
    draft, _ = _draft(target)
    row, aux = _flat()
    args = (row.input_ids[None], aux[None], row.is_masked[None], row.ref_pos[None], mask_for(row))
    names = ["embed_tokens", "fc", "layers.0.self_attn.q_proj", "layers.0.self_attn.v_proj",
             "layers.0.mlp.gate_proj", "layers.1.self_attn.k_proj", "layers.2.self_attn.o_proj",
             "layers.2.mlp.down_proj"]
    seen: list[str] = []
    handles = [draft.get_submodule(n).register_forward_hook(lambda _m, _a, _o, n=n: seen.append(n)) for n in names]
    with torch.no_grad():
        ref = draft(*args)
    for handle in handles:
        handle.remove()
    assert set(seen) == set(names) and seen.count("fc") == 2  # fc: real slots and mask_hidden
    handle = draft.layers[1].self_attn.q_proj.register_forward_hook(lambda _m, _a, out: out * 0.5)
    with torch.no_grad():
        hooked = draft(*args)
    handle.remove()
    assert not torch.allclose(hooked, ref)
    with torch.no_grad():
        torch.testing.assert_close(draft(*args), ref, rtol=0, atol=0)


def test_masked_slots_projected_once_give_the_same_values_and_grads(
    target: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peagle.model.draft import PEagleFirstLayer

    row, aux = _flat(seed=7, t=40)
    assert bool(row.is_masked.any()) and bool((~row.is_masked).any())
    seen, results = [], []
    real_forward = PEagleFirstLayer.forward
    for share in (True, False):
        def forward(self, *args, _share=share, **kw):  # type: ignore[no-untyped-def]
            seen.append(args[6] is not None)  # (emb, hid, cos, sin, mask, prefix, shared, kv)
            return real_forward(self, *(args if _share else (*args[:6], None, *args[7:])), **kw)

        monkeypatch.setattr(PEagleFirstLayer, "forward", forward)
        draft, _ = _draft(target)
        out = draft(row.input_ids[None], aux[None], row.is_masked[None], row.ref_pos[None], mask_for(row))
        (out * torch.linspace(-1, 1, out.shape[1])[None, :, None]).sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in draft.named_parameters()}))
    assert seen == [True, True]  # forward asked for the shared projection both times
    (out1, g1), (out0, g0) = results
    torch.testing.assert_close(out1, out0, rtol=1e-5, atol=1e-6)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)
    assert torch.count_nonzero(g1["mask_hidden"]) > 0


def test_layers_start_from_the_target_when_asked(target: torch.nn.Module) -> None:
    """`init_layers_from_target`: draft layer i <- target layer N-L+i, the fused q/k/v in both halves,
    fc passes on the last aux layer, the final norm is the target's; nothing else changes."""
    from peagle.model.initialization import init_layers_from_target

    draft, _ = _draft(target, layers=1)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    with torch.no_grad():
        target.model.norm.weight.uniform_(0.5, 1.5)  # not all ones: a copy is visible
        target.model.layers[-1].input_layernorm.weight.uniform_(0.5, 1.5)
    copied = init_layers_from_target(draft, target)
    src = target.model.layers[-1]
    first = draft.layers[0]
    for proj in ("q_proj", "k_proj", "v_proj"):
        w = getattr(src.self_attn, proj).weight
        torch.testing.assert_close(getattr(first.self_attn, proj).weight, torch.cat([w, w], dim=1))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        torch.testing.assert_close(getattr(first.mlp, proj).weight, getattr(src.mlp, proj).weight)
    torch.testing.assert_close(first.self_attn.o_proj.weight, src.self_attn.o_proj.weight)
    torch.testing.assert_close(first.hidden_norm.weight, src.input_layernorm.weight)
    torch.testing.assert_close(draft.norm.weight, target.model.norm.weight)
    torch.testing.assert_close(draft.fc.weight, torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], dim=1))
    after = draft.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed <= set(copied)  # only what it reports (a copy of ones onto ones changes nothing)
    assert {"fc.weight", "norm.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.hidden_norm.weight"} <= changed
    for key in ("embed_tokens.weight", "lm_head.weight", "mask_hidden", "d2t", "t2d"):
        assert torch.equal(after[key], before[key]), key
    two, _ = _draft(target, layers=2)
    init_layers_from_target(two, target)  # L=2 takes the target's last two layers, in order
    torch.testing.assert_close(two.layers[1].mlp.up_proj.weight, target.model.layers[-1].mlp.up_proj.weight)
    torch.testing.assert_close(two.layers[0].mlp.up_proj.weight, target.model.layers[-2].mlp.up_proj.weight)
    assert init_layers_from_target(two, torch.nn.Linear(2, 2)) == []  # no decoder stack: nothing copied


def test_the_run_draft_follows_the_spec_layer_init(target: torch.nn.Module) -> None:
    from types import SimpleNamespace

    from peagle.pipeline import build_initial_draft
    from peagle.spec import preset

    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:VD] = True
    vocab = SimpleNamespace(draft_vocab_size=VD, t2d=t2d)
    drafts = {}
    for init in ("target", "random"):
        spec = preset("tiny").model_copy(deep=True)
        spec.draft.layer_init = init
        spec.draft.num_layers = 1
        drafts[init] = build_initial_draft(spec, target, vocab, 7, [0, 1, 1])
    eye = torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], dim=1)
    assert torch.equal(drafts["target"].fc.weight, eye) and not torch.equal(drafts["random"].fc.weight, eye)
    w = target.model.layers[-1].mlp.up_proj.weight
    assert torch.equal(drafts["target"].layers[0].mlp.up_proj.weight, w)
    assert not torch.equal(drafts["random"].layers[0].mlp.up_proj.weight, w)
    assert torch.equal(drafts["target"].lm_head.weight, drafts["random"].lm_head.weight)  # same rows either way


def test_norms_are_copied_as_the_scale_they_apply() -> None:
    from peagle.model.initialization import _norm_scale

    class OnePlus(torch.nn.Module):  # Gemma-style RMSNorm: scale = 1 + w
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.linspace(-0.5, 0.5, 16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    plain = LlamaRMSNorm(16)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
    assert torch.equal(_norm_scale(plain), plain.weight.detach())
    gemma = OnePlus()
    assert torch.equal(_norm_scale(gemma), 1 + gemma.weight.detach())
    assert _norm_scale(torch.nn.LayerNorm(16)) is None  # not a pure per-channel scale: left alone


def test_feature_mean_is_the_mean_over_real_positions_of_every_batch() -> None:
    from peagle.model.initialization import feature_mean

    g = torch.Generator().manual_seed(0)
    a1, a2 = torch.randn(2, 5, 6, generator=g), torch.randn(1, 4, 6, generator=g)
    d1 = torch.tensor([[0, 0, 1, -1, -1], [2, 2, 2, 2, 2]])
    d2 = torch.tensor([[3, 3, -1, -1]])
    a1[d1 < 0] = 1e6  # padding slots must not count
    want = torch.cat([a1[d1 >= 0], a2[d2 >= 0]]).mean(0)
    torch.testing.assert_close(feature_mean([(a1, d1), (a2, d2)]), want)
    assert feature_mean([(a1.bfloat16(), d1)]).dtype == torch.float32
    with pytest.raises(ValueError, match="non-padding"):
        feature_mean([(a1, torch.full_like(d1, -1))])
    with pytest.raises(ValueError, match="non-padding"):
        feature_mean([])


def test_init_mask_hidden_checks_the_shape_and_finiteness(target: torch.nn.Module) -> None:
    from peagle.model.initialization import init_mask_hidden

    draft, _ = _draft(target, layers=1)
    mean = torch.linspace(-3.0, 300.0, 3 * H)
    init_mask_hidden(draft, mean)
    assert torch.equal(draft.mask_hidden.detach().reshape(-1), mean) and draft.mask_hidden.requires_grad
    with pytest.raises(ValueError, match=rf"\[{3 * H}\]"):
        init_mask_hidden(draft, torch.zeros(H))
    bad = mean.clone()
    bad[0] = math.nan
    with pytest.raises(ValueError, match="not finite"):
        init_mask_hidden(draft, bad)


def test_the_run_draft_follows_the_spec_mask_hidden_init() -> None:
    """`feature_mean`: mask_hidden is the mean target feature of the source's first micro-batches (epoch 0),
    captured by the real in-process capture; `random`: N(0, 1), the same with or without a source."""
    from types import SimpleNamespace

    from peagle.data.packing import pack_documents
    from peagle.model.initialization import feature_mean
    from peagle.pipeline import MASK_HIDDEN_BATCHES, build_initial_draft
    from peagle.spec import preset
    from peagle.target.capture import TargetCapture
    from peagle.target.sources import OnlineFeatureSource

    target = build_tiny_llama(vocab_size=V, hidden_size=H, num_heads=4, num_kv_heads=2, num_layers=4, seed=1)
    aux = [1, 2, 3]
    g = torch.Generator().manual_seed(3)
    docs = [(torch.randint(8, V, (n,), generator=g).tolist(), [0] * 2 + [1] * (n - 2))
            for n in (20, 31, 17, 25, 30, 12, 28, 19, 26, 22, 14, 29)]
    rows = pack_documents(docs, 32, seed=0)
    source = OnlineFeatureSource(TargetCapture(target, aux, None), rows, 1, 5)
    assert source.num_batches() > MASK_HIDDEN_BATCHES  # only the first ones count
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:VD] = True
    vocab = SimpleNamespace(draft_vocab_size=VD, t2d=t2d)
    spec = preset("tiny").model_copy(deep=True)
    spec.draft.num_layers = 1
    random_one = build_initial_draft(spec, target, vocab, 7, aux)
    assert torch.equal(build_initial_draft(spec, target, vocab, 7, aux, source).mask_hidden, random_one.mask_hidden)
    spec.draft.mask_hidden_init = "feature_mean"
    with pytest.raises(ValueError, match="needs the run's batch source"):
        build_initial_draft(spec, target, vocab, 7, aux)
    draft = build_initial_draft(spec, target, vocab, 7, aux, source)
    first = [source.batch(0, i) for i in range(MASK_HIDDEN_BATCHES)]
    want = feature_mean((b["aux"], b["document_ids"]) for b in first)
    torch.testing.assert_close(draft.mask_hidden.detach().reshape(-1), want)
    every = [source.batch(0, i) for i in range(source.num_batches())]
    assert not torch.allclose(want, feature_mean((b["aux"], b["document_ids"]) for b in every))
    assert not torch.allclose(draft.mask_hidden, random_one.mask_hidden)
    for key, value in random_one.state_dict().items():  # nothing else changes
        if key != "mask_hidden":
            torch.testing.assert_close(draft.state_dict()[key], value, equal_nan=True, msg=key)


def test_a_run_with_feature_mean_starts_mask_hidden_at_its_own_features(tmp_path, tiny_target_path) -> None:
    """The pipeline hands the run's own source to the draft's initialisation: after one step (lr 1e-3) the
    exported `mask_hidden` is the mean feature of the run's first micro-batches, not an N(0, 1) draw."""
    from safetensors.torch import load_file

    from peagle.model.initialization import feature_mean
    from peagle.pipeline import MASK_HIDDEN_BATCHES, run_pipeline
    from peagle.progress import RecordingSink
    from peagle.spec import parse_spec, preset
    from peagle.target.sources import OfflineFeatureSource

    data = preset("tiny").model_dump(mode="json")
    data["resources"]["capture"] = "offline"
    data["optim"]["max_steps"] = 1
    data["draft"]["mask_hidden_init"] = "feature_mean"
    data["eval"].update(prompt_sets=[], serve_check=False)
    spec = parse_spec(data)
    run = tmp_path / "run"
    run_pipeline(spec, run, sink=RecordingSink())
    source = OfflineFeatureSource(run / "data" / "features" / "train", spec.optim.micro_batch_size, spec.optim.seed)
    first = [source.batch(0, i) for i in range(min(MASK_HIDDEN_BATCHES, source.num_batches()))]
    want = feature_mean((b["aux"], b["document_ids"]) for b in first)
    got = load_file(run / "export" / "model.safetensors")["mask_hidden"].float().reshape(-1)
    assert float(want.abs().max()) < 0.1  # the tiny random target's states are small: an N(0, 1) draw is far
    torch.testing.assert_close(got, want, atol=3e-3, rtol=0.01)  # one AdamW step of at most 1e-3, bf16 export


def test_a_resumed_feature_mean_run_reads_no_batch_for_mask_hidden(tmp_path, tiny_target_path, monkeypatch) -> None:
    """A resumed run takes every weight from its checkpoint, so it does not read (for a streaming source,
    capture again) the first micro-batches for a `mask_hidden` start it would overwrite; it still ends
    exactly where the uninterrupted run did."""
    import shutil

    from safetensors.torch import load_file

    import peagle.model.initialization as init_mod
    import peagle.train.checkpoint as ckpt_mod
    from peagle.pipeline import run_pipeline
    from peagle.progress import RecordingSink
    from peagle.spec import parse_spec, preset

    data = preset("tiny").model_dump(mode="json")
    data["resources"]["capture"] = "offline"
    data["optim"]["max_steps"] = 2
    data["checkpoints"]["every_steps"] = 1
    data["draft"]["mask_hidden_init"] = "feature_mean"
    data["eval"].update(prompt_sets=[], serve_check=False)
    spec = parse_spec(data)
    run = tmp_path / "run"
    calls: list[int] = []
    real = init_mod.feature_mean
    monkeypatch.setattr(init_mod, "feature_mean", lambda batches: calls.append(1) or real(batches))
    run_pipeline(spec, run, sink=RecordingSink())
    assert calls == [1]  # a fresh run reads them
    first = load_file(run / "export" / "model.safetensors")
    shutil.rmtree(run / "checkpoints" / "step_000002")  # as if the run had died after step 1
    hashed: list[str] = []
    real_sha = ckpt_mod._sha256
    monkeypatch.setattr(ckpt_mod, "_sha256", lambda path: hashed.append(str(path)) or real_sha(path))
    sink = RecordingSink()
    run_pipeline(spec, run, sink=sink)
    assert any(r.get("kind") == "resumed" for r in sink.records)
    assert calls == [1]  # the resumed run read nothing for it
    read = [h for h in hashed if "step_000001" in h]
    assert read and len(read) == len(set(read)), read  # the checkpoint it resumed from was verified once
    for name, value in load_file(run / "export" / "model.safetensors").items():
        assert torch.equal(value, first[name]), name
