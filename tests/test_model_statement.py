"""train_gpt's model, objective and trainer step against the float64 statement in
tests/helpers/model_statement.py.

Two feature sets, each a preset narrowed in width only: the `cpu` preset's (a U-net trunk of 4
layers with two skip pairs, the bigram embedding, a shared value-embedding table, narrow QK
layers, full softmax) and the `speedrun` preset's 11 layers with every feature it turns on (the
dense trunk with record 92's attention-free, MLP-free layer and injection sites, token gates,
smear gate, n-gram table, sparse per-layer value embeddings, paired heads, XSA, key offset,
narrow QK and VO, a parallel MLP, output gates, the canonical mask at validation), here with
sampled softmax too; the `record89` preset's 11 layers
(its bigram table, paired heads in the records' layout, composed attention); the speedrun set
with record 92's final mix over full-width value-embedding tables; and the U-net trunk
with token gates and the attention features (no preset combines them); the cpu and speedrun sets
with the pointer mixture (PR 379), its band binding; the cpu and speedrun sets with the document
copy feature (PR 378), on slices whose documents repeat their own spans. Every parameter is
first moved away from its initial value, so that no path hides behind a zero or a one.

Tolerances. Both sides hold float64 parameters, but the model runs the softcap, the
cross-entropy and composed attention's maps in fp32 (the kernels' references cast there), so the
two agree to fp32 rounding, not to float64's: measured, the losses differ by ~1e-7 relative and
each gradient by ~1e-6 of its largest entry (1e-5 for the smallest gradients, where fp32 rounding
of larger terms cancels). The bounds are 1e-5 (losses, hidden states) and 1e-4 of the largest
entry (gradients), with an absolute floor of 1e-9 for gradients that are all near zero. A wiring
change moves them by far more: tests/mutation_check.py plants such changes.
"""
import os
import sys
import types

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import model_statement as ref  # noqa: E402

import kernels  # noqa: E402
import train_gpt as tg  # noqa: E402
from data.loader import TrainLoader  # noqa: E402
from data.shards import write_shard  # noqa: E402
from data.tokenizer import gpt2_encoding, noncanonical_pairs  # noqa: E402
from machinery import ngram_table, sampled_softmax  # noqa: E402

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4                   # of the largest entry of each gradient
GRAD_ATOL = 1e-9
VALIDATION_RTOL = 1e-6             # no backward, fp32 only in the softcap: measured 3e-8; the mask moves it 2e-5

# The presets' own layer lists, features and schedules; narrower, and computing in fp32 (no
# autocast) so that float64 parameters stay float64.
CPU_SET = ["--preset", "cpu", "--model_dim=64", "--head_dim=32", "--narrow_qk_dim=16", "--mlp_hidden=128",
           "--bigram_rows=1024", "--ngram_rows=0", "--compute_dtype=float32"]
SPEEDRUN_SET = ["--preset", "speedrun", "--model_dim=96", "--head_dim=16", "--narrow_qk_dim=8", "--narrow_vo_dim=8",
                "--mlp_hidden=128", "--ngram_rows=4096", "--composed_window=24", "--batch_ranks=1",
                "--compute_dtype=float32", "--compile=false", "--cuda_graphs=false"]
RECORD89_SET = ["--preset", "record89", "--model_dim=96", "--head_dim=16", "--mlp_hidden=128", "--bigram_rows=4096",
                "--composed_window=24", "--batch_ranks=1", "--compute_dtype=float32", "--compile=false",
                "--cuda_graphs=false"]
# The U-net trunk with the token gates and the attention features no preset combines with it.
UNET_GATED_SET = CPU_SET + ["--token_gates=true", "--token_gates_split=2", "--xsa_layers=[1]", "--attn_gate_layers=[3]",
                            "--composed_layers=[3]", "--composed_window=24", "--paired_head_layers=[2]", "--key_offset=true",
                            "--smear_gate=true", "--ngram_rows=2048", "--parallel_mlp_layers=[1]"]
# The speedrun set with record 92's final mix over full-width value-embedding tables.
RECORD92_MIX_SET = SPEEDRUN_SET + ["--value_embed_full_width=true", "--final_mix=record92"]
# The speedrun set with the n-gram table hashing normalized ids.
NORMALIZED_SET = SPEEDRUN_SET + ["--ngram_normalized=true"]
# The pointer mixture, narrow, with bands that bind in a 256-token slice of documents up to 96 tokens.
POINTER_KEYS = ["--pointer_mixture=true", "--pointer_dim=16", "--pointer_band=48", "--pointer_val_band=64"]
SETS = {"cpu": CPU_SET, "speedrun": SPEEDRUN_SET, "record92_mix": RECORD92_MIX_SET, "record89": RECORD89_SET,
        "unet_gated": UNET_GATED_SET, "normalized": NORMALIZED_SET, "cpu_pointer": CPU_SET + POINTER_KEYS,
        "speedrun_pointer": SPEEDRUN_SET + POINTER_KEYS, "cpu_copy": CPU_SET + ["--document_copy=true"],
        "speedrun_copy": SPEEDRUN_SET + ["--document_copy=true"]}
T = 256                            # tokens per slice
WINDOWS = (48, 160)                # (short, long) in tokens: both bind in a 256-token slice
HISTORY = ([128, 384, 640], [16, 48])  # the long and short windows the RoPE tables grew through
CANDIDATES = 2048                  # sampled-softmax columns (the speedrun set)


@torch.no_grad()
def away_from_init(model, seed):
    """Every parameter moved by noise of its own scale (zeros and ones included), the n-gram
    table filled; the gradient sinks stay zero (they only collect gradients)."""
    g = torch.Generator().manual_seed(seed)
    sinks = model.gradient_sinks()
    for p in model.parameters():
        if any(p is s for s in sinks):
            continue
        scale = 0.5 * p.abs().mean().item() if p.ndim >= 2 else 0.3
        p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (scale or 0.05))
    if model.ngram is not None:
        model.ngram.table.copy_(torch.randn(model.ngram.table.shape, generator=g) * 0.05)
    return model


@torch.no_grad()
def in_float64(model):
    """The model in float64, its RoPE tables recomputed there (not converted from fp32's)."""
    model.double()
    for rotary in (model.rotary, model.narrow_rotary):
        if rotary is not None:
            windows, rotary.windows = rotary.windows, None
            rotary.set_windows(windows)
    return model


def built(name, seed=0):
    h = tg.parse_config(SETS[name])
    torch.manual_seed(seed)
    fns = tg.KernelFns(kernels.attention_reference, kernels.softcap_cross_entropy_reference)
    model = in_float64(away_from_init(tg.build_model(h, fns), seed + 1))
    model.set_windows(*HISTORY)
    return h, model


def token_stream(seed, length=4000, repeats=False):
    """A BOS-separated stream of documents of 5 to 150 tokens over a 4,000-id vocabulary. With
    `repeats`, each document is pieces of 1-5 fresh ids and, as often, copies of one of its own
    earlier spans (1-40 tokens), a copied id replaced by another of its normalized id's ids one
    time in four: its contexts match at every length of the document copy feature, some only
    once normalized."""
    rng = np.random.default_rng(seed)
    normalized = ref.normalized_ids()[:4000].tolist() if repeats else []
    variants = {}
    for i, n in enumerate(normalized):
        variants.setdefault(n, []).append(i)

    def swap(ids):
        return [int(rng.choice(variants[normalized[x]])) if rng.random() < 0.25 else x for x in ids]
    out, total = [], 0
    while total < length:
        doc = np.concatenate([[ref.BOS], rng.integers(0, 4000, int(rng.integers(5, 150)))])
        if repeats:
            doc = [ref.BOS]
            for _ in range(int(rng.integers(3, 40))):
                start = int(rng.integers(1, len(doc))) if len(doc) > 1 else 0
                copy = swap(doc[start:start + int(rng.integers(1, 41))]) if start and rng.random() < 0.5 else []
                doc += copy or rng.integers(0, 4000, int(rng.integers(1, 6))).tolist()
            doc = np.array(doc)
        out.append(doc)
        total += doc.size
    return np.concatenate(out)[:length]


def leaves(model):
    """The statement's inputs: every parameter and trained table, as float64 leaves."""
    out = {name: p.detach().clone().requires_grad_(True) for name, p in model.named_parameters()}
    if model.ngram is not None:
        out["ngram.table"] = model.ngram.table.detach().clone().requires_grad_(True)
    for i, ve in enumerate(model.value_embeds):   # sparse value embeddings: no requires_grad on the model
        out[f"value_embeds.{i}.weight"] = ve.weight.detach().clone().requires_grad_(True)
    return out


def model_gradients(model, cfg, tokens):
    """{name: gradient} of what the model trains: its parameters, and the sparse tables'
    per-token gradients (their sinks') summed into the tables' rows."""
    sinks = {id(s) for s in model.gradient_sinks()}
    out = {name: p.grad for name, p in model.named_parameters() if id(p) not in sinks}
    n = len(tokens)
    if model.ngram is not None:
        brow, trow, _, _ = ref.ngram_rows(cfg, tokens)
        entries = model.ngram.sink.grad[:n]
        out["ngram.table"] = torch.zeros_like(model.ngram.table).index_add_(0, brow, entries[:, 0]) \
            .index_add_(0, trow, entries[:, 1])
    if model.value_sinks is not None:
        for i, (ve, sink) in enumerate(zip(model.value_embeds, model.value_sinks)):
            out[f"value_embeds.{i}.weight"] = torch.zeros_like(ve.weight).index_add_(0, tokens.long(), sink.grad[:n])
    return out


def assert_close(name, got, want, rtol, atol=0.0):
    assert got is not None and want is not None, f"{name}: a gradient is missing ({got is None}, {want is None})"
    scale = want.abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert err <= rtol * scale + atol, f"{name}: differs by {err:.3g} (largest entry {scale:.3g})"


@pytest.fixture(scope="module")
def tokenizer_bytes():
    """Each GPT-2 id's bytes, and the id of each token's bytes: the prefix targets' definition."""
    enc = gpt2_encoding()
    token_bytes = [enc.decode_single_token_bytes(i) for i in range(ref.BOS)]
    return token_bytes, {b: i for i, b in enumerate(token_bytes)}


@pytest.fixture(scope="module")
def masked_pairs():
    pairs = {}
    for p, c in noncanonical_pairs().tolist():
        pairs.setdefault(p, []).append(c)
    return pairs


def a_slice(seed=1, max_doc_len=96, repeats=False):
    tokens, targets, cu = ref.loader_slice(token_stream(seed, repeats=repeats), T, max_doc_len)
    return tokens, targets, cu


# ---------------------------------------------------------------------------------------------
# the model and its objective


@pytest.mark.parametrize("name, tied", [("cpu", True), ("speedrun", False), ("record92_mix", False), ("record89", True),
                                        ("unet_gated", True), ("normalized", False), ("cpu_pointer", True),
                                        ("speedrun_pointer", False), ("cpu_copy", True), ("speedrun_copy", False)])
def test_the_model_and_its_objective_equal_their_statement(name, tied, tokenizer_bytes):
    """Objective, next-token loss, hidden states and every trained gradient; the speedrun set
    with sampled softmax and the head untied, the cpu set with the full softmax and the head tied."""
    h, model = built(name)
    if not tied:
        model.untie()
        with torch.no_grad():
            model.lm_head.add_(torch.randn_like(model.lm_head) * 0.01)
    cfg = tg.model_config(h)
    tokens, targets, cu = a_slice(repeats=h.document_copy)
    if h.document_copy:
        assert len(set(ref.copy_matches(tokens)[1].tolist())) > 20, "the slice matches at most lengths and counts"
    weights = torch.tensor([1.0, 0.5, 0.25, 0.25])
    always = (ref.COPY_ID,) if h.pointer_mixture else ()
    columns = ref.candidates(targets, CANDIDATES, ref.candidate_start(5, 8), always) if not tied else None
    args = tg.AttentionArgs(cu.int(), *WINDOWS)
    objective, next_token = model(tokens.int(), targets, args, weights, columns)
    objective.backward()
    hidden = model.hidden_states(tokens.int(), args)

    P = leaves(model)
    prefix = ref.prefix_targets(targets[:, 0], *tokenizer_bytes)
    want, want_next = ref.objective(P, cfg, tokens, targets, cu, WINDOWS, HISTORY, weights, prefix, tied, columns)
    want.backward()
    assert abs(objective.item() - want.item()) <= LOSS_RTOL * abs(want.item())
    assert abs(next_token.item() - want_next.item()) <= LOSS_RTOL * abs(want_next.item())
    with torch.no_grad():
        assert_close("hidden states", hidden, ref.hidden_states(P, cfg, tokens, cu, WINDOWS, HISTORY), LOSS_RTOL)
    grads = model_gradients(model, cfg, tokens)
    assert (grads["lm_head"] is None) == tied
    for key, grad in grads.items():
        if key == "lm_head" and tied:
            continue
        assert_close(key, grad, P[key].grad, GRAD_RTOL, GRAD_ATOL)
    trained = {key for key, p in P.items() if p.grad is not None}
    assert trained == {key for key, g in grads.items() if g is not None}, "both train the same tensors"


# PR 371's truncated backward windows for the test: per head of each attention call (positions),
# exact (0) on some heads, tighter than both windows on others
BACKWARD_WINDOWS = (8, 0, 24, 4, 16, 64)


@pytest.mark.parametrize("name, tied", [("cpu", True), ("speedrun", False)])
def test_the_approximate_backward_equals_its_statement(name, tied, tokenizer_bytes):
    """PR 371's approximations on: the head's weight gradient from one row in four (the model's
    draw for a seed) times four, the input gradient exact; every attention layer's backward
    truncated per head (BACKWARD_WINDOWS, paired layers' calls taking the first half). The
    objective and every gradient equal the statement's (sampled_logits,
    truncated_backward_attention); the head's and the attention's gradients differ from the
    exact backward's, so the statement's approximations are the ones checked."""
    h, model = built(name)
    if not tied:
        model.untie()
        with torch.no_grad():
            model.lm_head.add_(torch.randn_like(model.lm_head) * 0.01)
    model.set_approximate_backward(4, True)
    model.set_head_sample_seed(12345)
    windows = {}
    for i, block in enumerate(model.blocks):
        if block.attn is not None:
            heads = h.num_heads // 2 if i in h.paired_head_layers else h.num_heads
            windows[i] = BACKWARD_WINDOWS[:heads]
            block.attn.set_backward_windows(torch.tensor(windows[i]))
    cfg = types.SimpleNamespace(**vars(tg.model_config(h)), backward_windows=windows)
    tokens, targets, cu = a_slice()
    weights = torch.tensor([1.0, 0.5, 0.25, 0.25])
    columns = ref.candidates(targets, CANDIDATES, ref.candidate_start(5, 8)) if not tied else None
    objective, _ = model(tokens.int(), targets, tg.AttentionArgs(cu.int(), *WINDOWS), weights, columns)
    objective.backward()

    P = leaves(model)
    prefix = ref.prefix_targets(targets[:, 0], *tokenizer_bytes)
    rows = kernels.head_sample_rows(T, 4, 12345)
    want, _ = ref.objective(P, cfg, tokens, targets, cu, WINDOWS, HISTORY, weights, prefix, tied, columns,
                            head_sample=(rows, 4))
    want.backward()
    assert abs(objective.item() - want.item()) <= LOSS_RTOL * abs(want.item())
    grads = model_gradients(model, cfg, tokens)
    for key, grad in grads.items():
        if grad is not None:
            assert_close(key, grad, P[key].grad, GRAD_RTOL, GRAD_ATOL)
    exact = leaves(model)
    ref.objective(exact, tg.model_config(h), tokens, targets, cu, WINDOWS, HISTORY, weights, prefix, tied,
                  columns)[0].backward()
    head = "embed.weight" if tied else "lm_head"
    first_attention = f"blocks.{min(windows)}.attn.qkv"
    for key in (head, first_attention):
        diff = (exact[key].grad - P[key].grad).abs().max().item()
        assert diff > 1e-3 * exact[key].grad.abs().max().item(), f"{key}: the approximation changes it"


@pytest.mark.parametrize("name", ["cpu", "speedrun", "cpu_pointer", "speedrun_pointer", "cpu_copy", "speedrun_copy"])
def test_the_validation_loss_equals_its_statement(name, masked_pairs):
    """The full-vocabulary validation sum at the final window, in eval mode: the speedrun sets with
    the canonical mask (masked pairs at -60 after the softcap), the cpu sets without; the pointer
    mixture at its validation band; the document copy feature."""
    h, model = built(name)
    assert h.canonical_mask == name.startswith("speedrun")
    model.eval()
    cfg = tg.model_config(h)
    tokens, targets, cu = a_slice(seed=2, repeats=h.document_copy)
    windows, history = (64, 224), (HISTORY[0] + [1024], HISTORY[1])
    model.set_windows(*history)
    got = model.validation_loss_sum(tokens.int(), targets, tg.AttentionArgs(cu.int(), *windows), chunk_rows=100)
    P = leaves(model)
    with torch.no_grad():
        want = ref.validation_loss_sum(P, cfg, tokens, targets, cu, windows, history,
                                       masked_pairs=masked_pairs if h.canonical_mask else None)
        plain = ref.validation_loss_sum(P, cfg, tokens, targets, cu, windows, history)
    assert abs(got.item() - want.item()) <= VALIDATION_RTOL * abs(want.item())
    if h.canonical_mask:
        assert plain.item() - want.item() > 1e-3, "the mask takes probability from pairs the slice never has"


# ---------------------------------------------------------------------------------------------
# the objective's inputs: the loader's targets and the candidates


@pytest.mark.parametrize("rule, segment", [("document", 0), ("packed", 0), ("packed", 32), ("document", 40)])
def test_the_loaders_slice_and_targets_equal_their_statement(tmp_path, rule, segment):
    """The first slice of a shard: whole documents cut at max_doc_len, the last cut to fit; the
    targets t+1, t+2, t+3 that stop at each document's end (its next BOS), or the packed slice's
    next tokens (the 32-token slice ends on a document cut at max_doc_len); attention segments at
    most `segment` tokens long (0: whole documents)."""
    stream = token_stream(3, 20_000)
    write_shard(tmp_path / "s_000000.bin", stream)
    for T_, max_doc_len in ((256, 96), (512, 40), (64, 1000), (256, 256), (32, 32)):
        loader = TrainLoader([str(tmp_path / "s_000000.bin")], T_, rule, segment)
        got = loader.next_batch(T_, max_doc_len, 1, [0])[0]
        tokens, targets, cu = ref.loader_slice(stream, T_, max_doc_len, rule=rule, segment=segment)
        assert torch.equal(got.tokens.long(), tokens) and torch.equal(got.targets, targets)
        real = got.cu_seqlens.tolist()
        assert real[:len(cu)] == cu.tolist() and set(real[len(cu):]) <= {T_}


@pytest.mark.parametrize("hashes, cross_documents", [("project", False), ("record", True), ("record", False)])
def test_the_hashed_tables_rows_equal_their_statement(hashes, cross_documents):
    """Every token's rows and sign rows in the n-gram table (record 92's 84,602,880 rows) and the
    bigram table (record 89's 377,280), over GPT-2's whole id range, where the records' int32
    products wrap."""
    rng = np.random.default_rng(5)
    tokens = torch.from_numpy(rng.integers(0, ref.BOS, 600))
    tokens[rng.integers(0, 600, 12)] = ref.BOS
    cfg = types.SimpleNamespace(ngram_rows=84_602_880, bigram_rows=377_280, table_hashes=hashes,
                                cross_documents=cross_documents)
    starts = ngram_table.token_starts(tokens, cross_documents)
    record = hashes == "record"
    brow, trow, sign_b, sign_t = ref.ngram_rows(cfg, tokens)
    assert torch.equal(ngram_table.ngram_rows(tokens, starts, cfg.ngram_rows, record), torch.stack([brow, trow], 1))
    assert torch.equal(ngram_table.bigram_sign_rows(tokens, starts, "record92" if record else "project"), sign_b)
    assert torch.equal(ngram_table.trigram_sign_rows(tokens, starts, record), sign_t)
    row, sign = ref.bigram_table_rows(cfg, tokens)
    assert torch.equal(ngram_table.bigram_rows(tokens, starts, cfg.bigram_rows, record), row)
    assert torch.equal(ngram_table.bigram_sign_rows(tokens, starts, "record89" if record else "project"), sign)


def test_normalized_ids_equal_their_statement():
    """Every id's normalized id, the table the n-gram hashes read with ngram_normalized, against the
    statement's restatement from GPT-2's token bytes; and the rows of a table that reads them."""
    assert torch.equal(ngram_table.normalized_ids(), ref.normalized_ids())
    rng = np.random.default_rng(6)
    tokens = torch.from_numpy(rng.integers(0, ref.BOS, 600))
    tokens[rng.integers(0, 600, 12)] = ref.BOS
    cfg = types.SimpleNamespace(ngram_rows=4096, table_hashes="record", cross_documents=True, ngram_normalized=True)
    table = ngram_table.NgramTable(cfg.ngram_rows, 8, 600, cross_documents=True, record_hashes=True, normalized=True)
    brow, trow, _, _ = ref.ngram_rows(cfg, tokens)
    assert torch.equal(table.slice_rows(tokens).reshape(-1, 2), torch.stack([brow, trow], 1))


@pytest.mark.parametrize("count", [900, 2048, 50304])
def test_candidates_equal_their_statement(count):
    tokens, targets, cu = a_slice()
    for slice_index, slices in ((0, 8), (3, 8), (7, 8), (5, 16)):
        start = ref.candidate_start(slice_index, slices)
        assert sampled_softmax.candidate_start(slice_index, slices) == start
        got = sampled_softmax.candidate_columns(targets, count, torch.tensor(start))
        assert torch.equal(got, ref.candidates(targets, count, start))


def test_the_prefix_targets_equal_their_statement(tokenizer_bytes):
    """The model's prefix table on every id (the longest proper byte prefix that is a token)."""
    _, model = built("cpu")
    ids = torch.arange(ref.BOS)
    assert torch.equal(model.prefix_table[ids], ref.prefix_targets(ids, *tokenizer_bytes))


# ---------------------------------------------------------------------------------------------
# a trainer step


SMALL_STAGES = ('--stages=[{"end":0.5,"tokens_per_rank":128,"max_doc_len":96,"short_window":1,"long_window":1,'
                '"mtp_weights":[1,0.5,0.25],"mtp_weights_end":[1,0.5,0],"prefix_weight":0.25,"candidates":1024},'
                '{"end":1.0,"tokens_per_rank":256,"max_doc_len":200,"short_window":1,"long_window":2,'
                '"mtp_weights":[1,0.5],"prefix_weight":0.25,"prefix_weight_end":0,"lr_mult":1.5}]')


def test_a_trainer_step_equals_the_statement_with_its_schedule(tmp_path, tokenizer_bytes):
    """Trainer.forward_backward at step 3 of 8 (the second micro-batch's offsets, the first stage's
    sampled softmax with its multi-token weights part-way along) and at step 6 (the second stage:
    wider windows, the long window grown once, the prefix weight part-way to 0), on the speedrun
    set with two micro-batches per step: the trainer's losses, dense gradients and the sparse
    tables' pending gradients equal the statement's mean over the micro-batches, with the schedule
    computed here by hand."""
    stream = token_stream(4, 30_000)
    write_shard(tmp_path / "t_train_000000.bin", stream)
    h = tg.parse_config(SPEEDRUN_SET + ["--num_iterations=8", "--batch_ranks=2", SMALL_STAGES,
                                        f"--train_files={tmp_path}/t_train_*.bin"])
    trainer = tg.Trainer(h, tg.ProcessGroup(0, 1, 0, torch.device("cpu")), tg.RunLog("unused", active=False))
    model = in_float64(away_from_init(trainer.model, 7))
    cfg = tg.model_config(h)
    # by hand: step s of 8 is in stage 0 while s / 8 < 0.5; windows in blocks of 128 tokens
    schedule = {3: dict(T=128, doc=96, windows=(128, 128), history=([128], [128]), columns=1024,
                        weights=[1.0, 0.5, 0.25 * (1 - 3 / 4), 0.25]),
                6: dict(T=256, doc=200, windows=(128, 256), history=([128, 256], [128]), columns=0,
                        weights=[1.0, 0.5, 0.0, 0.25 * (1 - 2 / 4)])}
    loader = TrainLoader([str(tmp_path / "t_train_000000.bin")], 2 * 256)
    for step, s in schedule.items():
        trainer.advance_to(step)
        slices = loader.next_batch(s["T"], s["doc"], 2, [0, 1])
        trainer.zero_grads()
        losses = trainer.forward_backward(step, slices)
        P = leaves(model)
        objective, next_token = 0.0, 0.0
        for index, piece in enumerate(slices):
            tokens, targets, cu = piece.tokens.long(), piece.targets, piece.cu_seqlens
            columns = (ref.candidates(targets, s["columns"], ref.candidate_start(index, 2)) if s["columns"]
                       else None)
            prefix = ref.prefix_targets(targets[:, 0], *tokenizer_bytes)
            o, n = ref.objective(P, cfg, tokens, targets, cu, s["windows"], s["history"],
                                 torch.tensor(s["weights"]), prefix, True, columns)
            objective, next_token = objective + o / 2, next_token + n / 2
        objective.backward()
        assert abs(losses[1].item() - objective.item()) <= LOSS_RTOL * objective.item(), step
        assert abs(losses[0].item() - next_token.item()) <= LOSS_RTOL * next_token.item(), step
        sinks = {id(p) for p in model.gradient_sinks()}
        for key, p in model.named_parameters():
            if id(p) not in sinks and p.requires_grad and key != "lm_head":
                assert_close(f"step {step}: {key}", p.grad, P[key].grad, GRAD_RTOL, GRAD_ATOL)
        rows, entries = (torch.cat(parts) for parts in zip(*trainer.tables.ngram_entries))
        table = torch.zeros_like(model.ngram.table).index_add_(0, rows, entries.double())
        assert_close(f"step {step}: ngram.table", table, P["ngram.table"].grad, GRAD_RTOL, GRAD_ATOL)
        for i, pending in enumerate(trainer.tables.value_grads):
            assert_close(f"step {step}: value_embeds.{i}", pending.sums,
                         P[f"value_embeds.{i}.weight"].grad, GRAD_RTOL, GRAD_ATOL)


def test_the_trainer_chooses_each_heads_backward_window_at_its_choice_steps(tmp_path):
    """PR 371's choice on the speedrun set: a probed step measures every attention call, after the
    last choice step each layer's table holds per head the smallest window within the bound
    (here 1.0: every head of a layer whose windows bind takes the smallest candidate, 0.0: none
    does), the choice is logged; the steps after it run truncated."""
    stream = token_stream(6, 20_000)
    write_shard(tmp_path / "t_train_000000.bin", stream)
    logged = []
    for bound, want in ((1.0, 8), (1e-9, 0)):
        h = tg.parse_config(SPEEDRUN_SET + ["--num_iterations=8", "--batch_ranks=1", SMALL_STAGES,
                                            f"--train_files={tmp_path}/t_train_*.bin", "--attn_bwd_windows=[8,64]",
                                            "--attn_bwd_choice_steps=[1]", "--attn_bwd_start=2",
                                            f"--attn_bwd_error_bound={bound}"])
        log = tg.RunLog("unused", active=False)
        log.write = lambda line, echo=False: logged.append(line)
        trainer = tg.Trainer(h, tg.ProcessGroup(0, 1, 0, torch.device("cpu")), log)
        loader = TrainLoader([str(tmp_path / "t_train_000000.bin")], 256)
        trainer.advance_to(1)
        trainer.forward_backward(1, loader.next_batch(128, 96, 1, [0]))
        attns = [b.attn for b in trainer.model.blocks if b.attn is not None]
        assert all(a.probe is None and not a.truncated for a in attns)
        assert all(a.backward_windows[:h.num_heads // 2].tolist() == [want] * (h.num_heads // 2) for a in attns)
        trainer.advance_to(2)
        assert all(a.truncated for a in attns)
    assert logged[-2].startswith("attention backward windows: layer 0: 8 8 8") and "full" in logged[-1]
