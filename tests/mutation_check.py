"""Plant plausible one-line bugs, one at a time, and check that the tests catch each.

    python tests/mutation_check.py                 # every mutation; prints the kill rate and the survivors
    python tests/mutation_check.py --list          # the mutations, numbered
    python tests/mutation_check.py 3 17            # only these
    python tests/mutation_check.py --group tools   # only one group's (see GROUPS)

Each mutation replaces one exact line fragment of a module in a copy of the repository, then
runs the test selection that should catch it there. The groups: the model and trainer
(train_gpt.py, optim.py, kernels.py: the references the trainer runs on a CPU; the n-gram table,
the sampled softmax and the canonical mask beside them in machinery/), and the
machinery around them (machinery/config.py's checks, machinery/checkpoint.py, records/ statistics and tools,
data/shards.py and the downloader, machinery/memory_budget.py, machinery/sparse_tables.py, machinery/processes.py). Every
selection is first run once on the unmutated copy and must pass there (a selection that fails
anyway would count every mutation as killed). A mutation is killed when its selection fails.
The repository itself is never written. Not collected by pytest (its name does not start with test_).
"""
import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 600                    # per mutation: a hung selection counts as a kill, and says so

STATEMENT = "tests/test_model_statement.py"
MODEL = [STATEMENT, "-k", "objective_equal"]
VALIDATION = [STATEMENT, "-k", "validation_loss"]
TRAINER_STEP = [STATEMENT, "-k", "trainer_step"]
SCHEDULES = ["tests/test_schedules.py"]
OPTIM = ["tests/test_optim.py"]
STARTS_CLOSED = ["tests/test_model.py", "-k", "start_as_the_plain_model"]
CONFIG_CHECKS = ["tests/test_failures.py", "-k", "test_bad_config_values_end_with_one_line"]
CHECKPOINT_FILE = ["tests/test_checkpoint.py", "-k", "safetensors or sha256 or header or byte_range or fifo or pieces"]
SAMPLING = ["tests/test_checkpoint.py", "-k", "temperature or top_k"]
STATISTICS = ["tests/test_records.py", "-k", "test_one_sample or spread or welch or runs_needed or too_little"]
STEPS_TRACK = ["tests/test_records_steps.py", "-k", "pairwise or margin or one_day or t_test"]
MAKE_RECORD = ["tests/test_records.py", "-k", "not baseline_script_writes and not cpu_records_are and not test_reproduce"]
RULES = ["tests/test_record_rules.py"]
INPUTS = ["tests/test_records_inputs.py"]
RESULTS_FILE = ["tests/test_downstream.py", "-k", "output or results_that"]
NAN_SAMPLE = ["tests/test_checkpoint.py", "-k", "nan_weights"]
STEP_MODEL_JSON = ["tests/test_step_model.py", "-k", "json_path"]
PLAN_MEMORY = ["tests/test_failures.py", "-k", "plan_for_memory"]
LOG_FORMAT = ["tests/test_records.py", "-k", "parse_log or seal or hostile or dirty or machine_and or writer or crlf "
              "or truncated or escaping or run_id or binary or fifo or newline or tampered"]
REPRODUCE = ["tests/test_records.py", "-k", "reproduce"]
SHARDS = ["tests/test_data.py", "-k", "shard or header or fingerprint or download or hubs_size"]
MEMORY = ["tests/test_memory.py", "-k", "counts_what_a_cpu_run_holds or pinned or row_gradient_sums"]
CPU_MEMORY = ["tests/test_failures.py", "-k", "too_big"]
SPARSE = ["tests/test_sparse_tables.py", "-k", "vocab_row_gradients or host_tables_cache or cannot_be_split"]
TRAVEL = ["tests/test_sparse_tables.py", "tests/test_routing.py", "-k", "travel"]
FUSED_CASTS = ["tests/test_kernels.py", "-k", "fp8_cast_saturates or fused_casts"]
XSA_DTYPE = ["tests/test_cuda_path.py", "-k", "xsa"]
FRONTIER_REPLAYS = ["tests/test_cuda_path.py", "-k", "two_steps_of_one and frontier"]
UNEVEN_SPLIT = ["tests/test_failures.py", "-k", "does_not_split_across"]
LAUNCH = ["tests/test_failures.py", "-k", "bad_launch_environment"]
HANGUP = ["tests/test_failures.py", "-k", "SIGHUP"]
APPROX = "tests/test_approximate_backward.py"
TRUNCATED_KERNELS = [APPROX, "-k", "kernels_truncated_backward_equals"]
TRUNCATED_REFERENCE = [APPROX, "-k", "reference_truncated_backward"]
WINDOW_CHOOSER = [APPROX, "-k", "chooser"]
SAMPLED_HEAD = [APPROX, "-k", "sampled_rows or sampled_linear"]
CHUNKED_MIXTURE = ["tests/test_kernels.py", "-k", "chunked_pointer_mixture"]
SAMPLED_FP8 = [APPROX, "-k", "fp8_heads_sampled"]
APPROX_SCHEDULE = [APPROX, "-k", "pr_371"]
APPROX_STATEMENT = [STATEMENT, "-k", "approximate_backward"]
WINDOW_TRAINER = [STATEMENT, "-k", "chooses"]
POINTER = [STATEMENT, "-k", "pointer"]
POINTER_KERNEL = ["tests/test_kernels.py", "-k", "pointer"]
POINTER_TRAINER = ["tests/test_model.py", "-k", "pointer"]
POINTER_CE = ["tests/test_kernels.py", "-k", "mixture_cross_entropy_kernel"]
DOC_COPY = "tests/test_document_copy.py"
COPY_DEFINITION = [DOC_COPY, "-k", "by_definition"]
COPY_KERNEL = [DOC_COPY, "-k", "keys_kernel_equals"]
COPY_MATCH = [DOC_COPY, "-k", "longest_latest"]
COPY_CAUSAL = [DOC_COPY, "-k", "after_its_position"]
COPY_MODEL = [STATEMENT, "-k", "objective_equal and copy"]
COPY_VALIDATION = [STATEMENT, "-k", "validation_loss and copy"]
COPY_GROUP = ["tests/test_model.py", "-k", "document_copy"]
COPY_CACHE = ["tests/test_checkpoint.py", "-k", "kv_cache and copy"]
RECORD_SCHEDULES = ["tests/test_record_schedules.py"]
VALUE_ADAM = ["tests/test_train.py", "-k", "follows_the_tables"]
MATRIX_SHAPES = ["tests/test_train.py", "-k", "record_banks"]
ADAM_GROUPS = ["tests/test_train.py", "-k", "adam_groups"]
HELP = ["tests/test_help.py", "-k", "meaning"]
ARGUMENTS = ["tests/test_config.py", "-k", "two_arguments or without_a_preset"]
TIME_LEFT = ["tests/test_run_report.py", "-k", "time_left or how_far"]
SINK = ["tests/test_metrics.py", "-k", "mirrors"]
INSTALL = ["tests/test_install.py", "-k", "cpu_only or without_triton"]
RESUME = ["tests/test_resume.py", "-k", "bit_for_bit"]
LOSS_UNIT = ["tests/test_train.py", "-k", "loss_unit"]
PEAK_STAGE = ["tests/test_memory.py", "-k", "largest_of_its_stages"]
WRITE_BACK = ["tests/test_sparse_tables.py", "-k", "sync_check_lifted or device_cache_trains"]
FIRST_CONTACT = ["tests/test_first_contact.py", "-k", "comes_first or two_stages or caches_travel or stopped_in"]
FIRST_CONTACT_DRY = ["tests/test_first_contact.py", "-k", "warms_up_each_graph"]
CAPTURES = ["tests/test_train.py", "-k", "captures_every_key and hashed"]
TMA_GEMM = ["tests/test_kernels.py", "-k", "fp8_tma_matmul"]
TMA_EPILOGUES = ["tests/test_kernels.py", "-k", "fp8_tma_relu2"]
SPLIT_PLAN = ["tests/test_kernels.py", "-k", "split_k_plan"]
FUSED_ATTENTION = ["tests/test_kernels.py", "-k", "presets_windows_in_blocks and atomic"]
DESCRIPTOR_ATTENTION = ["tests/test_kernels.py", "-k", "descriptor_variants_match_float64"]
KERNEL_CHOICE = ["tests/test_kernel_choice.py"]
STRUCTURE_PRICES = ["tests/test_step_model.py", "-k", "reference_shape or short_k or span_law"]


@dataclasses.dataclass
class Mutation:
    path: str
    old: str                       # must occur exactly once in the file
    new: str
    tests: list
    what: str

    @property
    def group(self):
        return "model" if self.path in MODEL_FILES else "machinery"


MODEL_FILES = ("train_gpt.py", "optim.py", "kernels.py", "machinery/ngram_table.py", "machinery/sampled_softmax.py",
               "machinery/canonical_mask.py")  # the model and trainer group; everything else: machinery
GROUPS = ("model", "machinery")


MUTATIONS = [
    # the model's wiring
    Mutation("train_gpt.py", "prefix = torch.where(targets[:, :1] >= 0, self.prefix_table[targets[:, :1].clamp(min=0)], -1)",
             "prefix = torch.where(targets[:, 1:2] >= 0, self.prefix_table[targets[:, 1:2].clamp(min=0)], -1)",
             MODEL, "the prefix target read from the second target's column"),
    Mutation("train_gpt.py", "x = x + self.skip_weights[j] * skips.pop()",
             "x = x + self.skip_weights[j] * skips.pop(0)", MODEL, "U-net skips paired first-to-first"),
    Mutation("train_gpt.py", "x = self.lambdas[0] * x + self.lambdas[1] * x0",
             "x = self.lambdas[1] * x + self.lambdas[0] * x0", MODEL, "the residual mix's lambdas swapped"),
    Mutation("train_gpt.py", "return x + torch.where(doc_start[:, None], 0.0, gate * torch.roll(x, 1, dims=0))",
             "return x + torch.where(doc_start[:, None], 0.0, gate * torch.roll(x, -1, dims=0))",
             MODEL, "the smear gate takes the next token"),
    Mutation("machinery/ngram_table.py", "BIGRAM_MULT_PREV = 27191", "BIGRAM_MULT_PREV = 27197", MODEL,
             "a typo in the bigram hash"),
    Mutation("machinery/ngram_table.py", "% (rows - half - 1)", "% (rows - half)", MODEL,
             "the trigram hash reaches the reserved row"),
    Mutation("machinery/ngram_table.py", "return torch.where(first_two, BOS_ID, torch.roll(tokens, 2)), first_two",
             "return torch.where(first_two, BOS_ID, torch.roll(tokens, 1)), first_two", MODEL,
             "the trigram's second token is the previous one"),
    Mutation("machinery/ngram_table.py", "signs[trigram_sign_rows(ids, is_start, self.record_hashes)[seen:]])",
             "signs[bigram_sign_rows(ids, is_start, rule)[seen:]])", MODEL,
             "the trigram channel takes the bigram's signs"),
    Mutation("machinery/ngram_table.py", "    return (x + 2 ** 31) % 2 ** 32 - 2 ** 31", "    return x",
             [STATEMENT, "-k", "hashed"],
             "the records' hashes without the int32 wrap"),
    Mutation("machinery/ngram_table.py", "        prev = torch.where(after_starts(is_doc_start), rows - 1, prev)\n", "", MODEL,
             "the records' bigram hash: the token after a start reads its true predecessor"),
    Mutation("machinery/ngram_table.py", "a, b = (1, 1) if rule == \"record89\" else RECORD_BIGRAM_SIGN_MULTS",
             "a, b = (1, 1) if rule == \"record89\" else (SIGN_MULT_CUR, SIGN_MULT_PREV)", MODEL,
             "record 92's bigram signs with our multipliers"),
    Mutation("machinery/ngram_table.py", "    return torch.where(first_two, 0, rows) if record else rows", "    return rows",
             [STATEMENT, "-k", "hashed"],
             "record 92's trigram sign rows: no row 0 for a document's first two tokens"),
    Mutation("machinery/ngram_table.py", "        return torch.arange(context.shape[0], device=context.device) == 0",
             "        return document_starts(context)", MODEL, "cross_documents: documents still start at their BOS"),
    Mutation("machinery/ngram_table.py", "return self.rows_of(tokens, token_starts(tokens, self.cross_documents)).reshape(-1)",
             "return self.rows_of(tokens, document_starts(tokens)).reshape(-1)", TRAINER_STEP,
             "the trainer's n-gram rows bounded by documents where the model's are not"),
    Mutation("machinery/ngram_table.py", "return torch.cat([context.new_ones(1, dtype=torch.bool), context[1:] == BOS_ID])",
             "return torch.cat([context.new_ones(1, dtype=torch.bool), context[:-1] == BOS_ID])", MODEL,
             "a document starts after its BOS"),
    Mutation("train_gpt.py", "return 2 * torch.sigmoid(F.linear(inputs, self.ve_gate.type_as(x)))",
             "return torch.sigmoid(F.linear(inputs, self.ve_gate.type_as(x)))", MODEL,
             "the value-embedding gate in (0, 1)"),
    Mutation("machinery/config.py", "return {**{i: i for i in range(tables)}, **{n - tables + i: i for i in range(tables)}}",
             "return {**{i: i for i in range(tables)}, **{n - tables + i - 1: i for i in range(tables)}}", MODEL,
             "shared value embeddings one layer early"),
    Mutation("train_gpt.py", "return y - torch.tanh(alpha).type_as(y)[..., None] * along * direction",
             "return y + torch.tanh(alpha).type_as(y)[..., None] * along * direction", MODEL,
             "XSA adds the own-value share"),
    Mutation("train_gpt.py", "return x.view(T, H // 2, 2, D).transpose(1, 2).reshape(2 * T, H // 2, D)",
             "return x.view(T, 2, H // 2, D).reshape(2 * T, H // 2, D)",
             ["tests/test_model.py", "-k", "paired_heads_see_each_others_keys"],
             "paired heads (the adjacent layout): head h with head h + H/2"),
    Mutation("train_gpt.py", "window = (args.long_window if self.long_window else args.short_window) + self.edge_keys",
             "window = args.long_window if self.long_window else args.short_window", MODEL,
             "the window's edge key left out"),
    Mutation("train_gpt.py", "            return tuple(t.to(v.dtype).reshape(2 * T, H // 2, -1) for t in (q, k, v))",
             "            return tuple(interleave_head_pairs(t.to(v.dtype)) for t in (q, k, v))", MODEL,
             "the records' paired layout as the adjacent one"),
    Mutation("train_gpt.py",
             "y = y.reshape(T, self.num_heads, -1) if self.record_pairs else deinterleave_head_pairs(y)",
             "y = deinterleave_head_pairs(y)", MODEL, "the records' paired outputs read back in the adjacent layout"),
    Mutation("train_gpt.py",
             "self.narrow_rotary.set_windows(short_windows if self.narrow_yarn_short else long_windows)",
             "self.narrow_rotary.set_windows(long_windows)", MODEL, "the narrow layers' YaRN follows the long window"),
    Mutation("train_gpt.py", "        if cfg.attn_out_init == \"uniform\":\n"
             "            nn.init.uniform_(self.out, -bound, bound)",
             "        if cfg.attn_out_init == \"uniform\":\n"
             "            nn.init.uniform_(self.out, -bound / 2, bound / 2)",
             ["tests/test_model.py", "-k", "attention_output_init"], "the output projection's uniform init halved"),
    Mutation("train_gpt.py", "q, k, v = (t.view(T, H, -1) for t in qkv.split(",
             "k, q, v = (t.view(T, H, -1) for t in qkv.split(", MODEL, "queries and keys swapped"),
    Mutation("train_gpt.py", "        if \"attn\" in gates:\n            y = y * gates[\"attn\"]",
             "        if \"attn\" in gates:\n            y = y * 2 * gates[\"attn\"]", MODEL,
             "the output gate doubled"),
    Mutation("train_gpt.py", "mix_in = F.rms_norm(gates[\"composed_in\"].float(), (self.num_heads,), eps=COMPOSED_MIX_EPS)",
             "mix_in = gates[\"composed_in\"].float()", MODEL, "composed attention's input mix not normed"),
    Mutation("train_gpt.py", "return F.linear(F.relu(F.linear(x, self.up.type_as(x))).square(), down.type_as(x))",
             "return F.linear(F.relu(F.linear(x, self.up.type_as(x))), down.type_as(x))", MODEL,
             "ReLU instead of ReLU^2"),
    Mutation("train_gpt.py", "return self.mlp(normed, casts, gain) + self.parallel_mlp(normed, casts, gain)",
             "return self.mlp(normed, casts, gain) + self.mlp(normed, casts, gain)", MODEL, "the parallel MLP's weights unused"),
    Mutation("train_gpt.py", "                x = x + gates[\"x0\"] * x0",
             "                x = x + gates[\"bigram\"] * x0", MODEL, "the x0 injection through the bigram's gate"),
    Mutation("train_gpt.py", "        elif self.scales_without_attention:\n            x = self.resid_scales[0] * x",
             "        elif self.scales_without_attention:\n            x = x", MODEL,
             "an attention-free layer leaves its residual unscaled"),
    Mutation("train_gpt.py",
             "self.scales_without_attention = not has_attn and cfg.trunk == \"dense\" and layer != cfg.skip_layers[1]",
             "self.scales_without_attention = not has_attn and cfg.trunk == \"dense\"", MODEL,
             "the skip's target scales its residual too"),
    Mutation("train_gpt.py", "        if self.mlp is None:\n            return self.resid_scales[1] * x",
             "        if self.mlp is None:\n            return x", MODEL,
             "an MLP-free layer leaves its residual unscaled"),
    Mutation("train_gpt.py", "(\"hashed\", hashed_layers))\n                   if layer in sites]",
             "(\"hashed\", hashed_layers))\n                   if layer not in cfg.attention_free_layers]", MODEL,
             "the injections after every attention layer, whatever the sites"),
    Mutation("train_gpt.py", "x = x0 + gates[0][\"hashed\"] * hashed if \"hashed\" in gates.get(0, {}) else x0",
             "x = x0", MODEL, "the dense trunk's input without the hashed embedding"),
    Mutation("train_gpt.py", "attn_in = saved[\"snapshot\"] if i > self.snapshot_layer else x",
             "attn_in = x", MODEL, "the layers after the snapshot attend from their own residual"),
    Mutation("train_gpt.py", "x = x + torch.sigmoid(self.skip_lambda) * gates[i][\"skip\"] * saved[\"skip_source\"]",
             "x = x + torch.sigmoid(self.skip_lambda) * saved[\"skip_source\"]", MODEL, "the dense skip ungated"),
    Mutation("train_gpt.py", "+ final[\"last_input\"] * saved[\"last_input\"]",
             "+ final[\"last_input\"] * saved[\"input\"]", MODEL, "the final mix reads the input twice"),
    Mutation("train_gpt.py", "share = coefficients[:, k, None] + deltas[:, k]", "share = coefficients[:, k, None]",
             MODEL,
             "record 92's final mix without its channel groups' deltas"),
    Mutation("train_gpt.py", "{**saved, **tables, \"attn_input\": rms_norm(saved[\"snapshot\"])}",
             "{**saved, **tables, \"attn_input\": saved[\"snapshot\"]}", MODEL,
             "record 92's final mix: the snapshot unnormed as the attention input"),
    Mutation("train_gpt.py", "        return mix[\"mlp_residual\"] * x + mix[\"mlp_out\"] * out, normed",
             "        return mix[\"mlp_residual\"] * x + mix[\"mlp_out\"] * out, x", MODEL,
             "record 92's final mix: the last MLP's input unnormed"),
    Mutation("train_gpt.py", "ve.view(T, H, -1)[..., :self.v_dim]", "ve.view(T, H, -1)[..., -self.v_dim:]", MODEL,
             "a narrow layer adds each head's last dims of a full-width table"),
    Mutation("train_gpt.py", "\"attn_residual\": 1.1 ** 0.5, \"attn_out\": 1.0,",
             "\"attn_out\": 1.0, \"attn_residual\": 1.1 ** 0.5,", MODEL,
             "the last layer's coefficients in another order"),
    Mutation("train_gpt.py", "            if i == self.token_gates_split:\n                gates.update(self.token_gates(1, x))",
             "            if i == self.token_gates_split + 1:\n                gates.update(self.token_gates(1, x))",
             MODEL, "the second gate MLP reads a later residual"),
    Mutation("train_gpt.py", "for kind, sites in ((\"x0\", x0_layers), (\"hashed\", hashed_layers))",
             "for kind, sites in ((\"hashed\", hashed_layers), (\"x0\", x0_layers))", MODEL,
             "the token gates' outputs in another order"),
    Mutation("train_gpt.py", "scale *= 1 + self.scale_growth * math.log(new / old)",
             "scale *= 1 + self.scale_growth * math.log(new / old) / 2", MODEL, "YaRN's scale growth halved"),
    Mutation("train_gpt.py", "return freq * (ratio + keep * (1 - ratio))", "return freq * (ratio + keep * ratio)",
             MODEL, "YaRN's ramp inverted"),
    Mutation("machinery/sampled_softmax.py", "pos = torch.searchsorted(columns, ids.clamp(min=0)).clamp(max=columns.numel() - 1)\n"
             "    return torch.where((ids >= 0) & (columns[pos] == ids), pos, -1)",
             "pos = torch.searchsorted(columns, ids.clamp(min=0)).clamp(max=columns.numel() - 1)\n"
             "    return torch.where(ids >= 0, pos, -1)", MODEL, "a target outside the candidates scored anyway"),
    Mutation("machinery/sampled_softmax.py", "priority = walk_position + V * (~is_target)", "priority = walk_position + V * is_target",
             [STATEMENT, "-k", "candidates"], "candidates: negatives first"),
    Mutation("machinery/canonical_mask.py", "self.register_buffer(\"bit_values\", 1 << torch.arange(8, dtype=torch.uint8), persistent=False)",
             "self.register_buffer(\"bit_values\", 1 << torch.arange(7, -1, -1, dtype=torch.uint8), persistent=False)",
             [STATEMENT, "tests/test_model.py", "-k", "validation_loss or canonical_mask_matches"],
             "the canonical mask reads each byte's bits in reverse"),
    Mutation("train_gpt.py", "                total += self.canonical_mask.cross_entropy_sum(logits, tokens[s:s + chunk_rows],",
             "                total += self.canonical_mask.cross_entropy_sum(logits, targets[s:s + chunk_rows, 0],",
             VALIDATION, "the canonical mask keyed by the target instead of the previous token"),
    Mutation("train_gpt.py", "total += self.cross_entropy_fn(logits, targets[s:s + chunk_rows, :1], one)[0].sum()",
             "total += self.cross_entropy_fn(logits, targets[s:s + chunk_rows, 1:2], one)[0].sum()", VALIDATION,
             "validation scores the second target"),
    Mutation("data/loader.py", "ok = (p <= doc_end) & (p < stream.size)", "ok = (p < doc_end) & (p < stream.size)",
             [STATEMENT, "-k", "loader"], "a document's last token predicts nothing"),
    Mutation("data/loader.py", "        out[:buffer.size - 1 - k, k] = buffer[k + 1:]",
             "        out[:buffer.size - k, k] = buffer[k:]", [STATEMENT, "-k", "loader"],
             "packed targets: each token predicts itself"),
    Mutation("data/loader.py", "if length < max_doc_len and start + length < stream.size else BOS_ID",
             "if start + length < stream.size else BOS_ID", [STATEMENT, "-k", "loader"],
             "packed targets: a slice ending on a cut document predicts its true successor"),
    Mutation("data/loader.py", "inner = range(offset + segment_tokens, offset + length, segment_tokens)",
             "inner = range(segment_tokens, offset + length, segment_tokens)",
             [STATEMENT, "-k", "loader"], "attention segments counted from the slice's start"),
    Mutation("train_gpt.py", "self.xsa_alpha = nn.Parameter(torch.zeros(cfg.num_heads)) if xsa and not cfg.token_gates else None",
             "self.xsa_alpha = nn.Parameter(torch.full((cfg.num_heads,), 3.0)) if xsa and not cfg.token_gates else None",
             STARTS_CLOSED, "XSA starts open"),
    Mutation("train_gpt.py", "self.smear_lambda = nn.Parameter(torch.zeros(()))",
             "self.smear_lambda = nn.Parameter(torch.full((), 0.5))", STARTS_CLOSED, "the smear gate starts open"),
    # the trainer's wiring
    Mutation("train_gpt.py", "(objective / self.accum).backward()", "objective.backward()", TRAINER_STEP,
             "micro-batch gradients summed, not averaged"),
    Mutation("train_gpt.py", "self.walk = torch.tensor([candidate_start(i, self.h.batch_ranks) for i in",
             "self.walk = torch.tensor([candidate_start(0, self.h.batch_ranks) for i in", TRAINER_STEP,
             "every micro-batch draws the same negatives"),
    Mutation("machinery/sparse_tables.py", "            grads.zero_()\n        if self.value_adams:",
             "        if self.value_adams:", TRAINER_STEP, "the n-gram sink not cleared between micro-batches"),
    Mutation("train_gpt.py", "mtp = [a + (b - a) * progress for a, b in zip(stage.mtp_weights, end)]",
             "mtp = [a + (b - a) * (1 - progress) for a, b in zip(stage.mtp_weights, end)]", [STATEMENT, "tests/test_schedules.py", "-k", "trainer_step or target_weights"],
             "multi-token weights move backwards"),
    # the schedules
    Mutation("train_gpt.py", "return mult + (h.cooldown_floor - mult) * t", "return h.cooldown_floor + (mult - h.cooldown_floor) * t",
             SCHEDULES, "the cooldown runs from the floor up"),
    Mutation("train_gpt.py", "return low + (high - low) * min(up, down)", "return low + (high - low) * max(up, down)",
             SCHEDULES, "the momenta never fall back"),
    Mutation("train_gpt.py", "return 1.0 if step / h.num_iterations < h.anvil_blend_start else h.anvil_blend",
             "return h.anvil_blend if step / h.num_iterations < h.anvil_blend_start else 1.0", SCHEDULES,
             "ANVIL's blend phases swapped"),
    Mutation("train_gpt.py", "down = min(max((end - x) / fall, 0.0), 1.0) if fall > 0 else 1.0",
             "down = min(max((end - x - 1) / fall, 0.0), 1.0) if fall > 0 else 1.0", SCHEDULES,
             "the momenta's fall off by one step"),
    Mutation("train_gpt.py", "    if final_validation and h.yarn_at_final_window:",
             "    if final_validation:", SCHEDULES, "YaRN at the final window regardless of the setting"),
    Mutation("train_gpt.py", "started = [p for p in h.table_phases if p.start <= step]",
             "started = [p for p in h.table_phases if p.start < step]", SCHEDULES, "a table phase a step late"),
    # the optimizers
    Mutation("optim.py", "blended = torch.lerp(state[\"slow_rail\"], state[\"fast_rail\"], hyper[\"blend\"])",
             "blended = torch.lerp(state[\"fast_rail\"], state[\"slow_rail\"], hyper[\"blend\"])", OPTIM,
             "ANVIL's blend weights the wrong rail"),
    Mutation("optim.py", "return torch.lerp(g, blended, hyper[\"mu\"])", "return torch.lerp(blended, g, hyper[\"mu\"])",
             OPTIM, "Nesterov's lerp reversed"),
    Mutation("optim.py", "return max(1.0, rows / cols) ** 0.5", "return max(1.0, cols / rows) ** 0.5", OPTIM,
             "the shape multiplier favours wide matrices"),
    Mutation("optim.py", "return torch.sign(a) * torch.sign(b) >= 0", "return torch.sign(a) * torch.sign(b) > 0",
             OPTIM, "cautious decay skips zero signs"),
    Mutation("optim.py", "(3.505298394150, -5.137358782410, 1.968325560615),",
             "(3.505298394150, -5.137358782410, 1.968352560615),", OPTIM, "a typo in an ANVIL coefficient"),
    Mutation("optim.py", "norm_factor=1.02,", "norm_factor=1.05,", OPTIM, "Polar Express normalized as ANVIL"),
    Mutation("optim.py", "mean_square = update.square().mean(dim=-1 if row_lanes else -2, keepdim=True)",
             "mean_square = update.square().mean(dim=-2 if row_lanes else -1, keepdim=True)", OPTIM,
             "NorMuon equalizes the short lanes"),
    Mutation("optim.py", "return dict(step_scale=lr / (1 - beta1 ** t), inv_sqrt_bias2=(1 - beta2 ** t) ** -0.5,",
             "return dict(step_scale=lr / (1 - beta1 ** t), inv_sqrt_bias2=(1 - beta2 ** t) ** 0.5,", OPTIM,
             "Adam's second-moment bias correction inverted"),
    Mutation("optim.py", "torch.mul(update, master, out=decayed).gt_(0).mul_(master)",
             "torch.mul(update, master, out=decayed).lt_(0).mul_(master)", OPTIM, "Adam's cautious decay on the wrong side"),
    # a Triton kernel (the interpreter runs it against the reference path)
    Mutation("kernels.py", "grad = grad_z * z * (1.0 - z / SOFTCAP) / TEMP * grad_scale",
             "grad = grad_z * z * (1.0 - z / SOFTCAP) * grad_scale",
             ["tests/test_triton_trainer.py"], "the Triton cross-entropy's gradient misses the softcap's 1/temperature"),
    # the kernels' references the trainer runs on a CPU
    Mutation("kernels.py", "return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)",
             "return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)", MODEL, "RoPE turns the other way"),
    Mutation("kernels.py", "take_previous = stationary & ~doc_start[:, None, None]",
             "take_previous = ~stationary & ~doc_start[:, None, None]", MODEL, "the key offset moves the rotating dims"),
    Mutation("kernels.py", "            visible &= qi - kj < window", "            visible &= qi - kj <= window", MODEL,
             "the attention window one key wider"),
    Mutation("kernels.py", "& (k_pos[:, None, :] >= first[:, :, None]))",
             "& (k_pos[:, None, :] >= first[:, :, None] - 1))", MODEL,
             "composed attention sees the previous document's last token"),
    Mutation("kernels.py", "return SOFTCAP * torch.sigmoid((logits.float() + SOFTCAP_SHIFT) / SOFTCAP_TEMP)",
             "return SOFTCAP * torch.sigmoid((logits.float() - SOFTCAP_SHIFT) / SOFTCAP_TEMP)", MODEL,
             "the softcap shifted the other way"),
    Mutation("kernels.py", "    return (losses * weights.to(losses)).sum(dim=1), losses[:, 0].detach()",
             "    return (losses * weights.to(losses)).sum(dim=1), losses[:, 1].detach()", MODEL,
             "the next-token loss read from the second target"),
    Mutation("kernels.py", "ex.scatter_add_(1, columns[s:e], w * -slope)", "ex.scatter_add_(1, columns[s:e], w * slope)",
             TRAINER_STEP, "the CPU cross-entropy's gradient pushes targets down"),
    Mutation("kernels.py", "th.copy_(logits[s:e]).add_(SOFTCAP_SHIFT).mul_(0.5 / SOFTCAP_TEMP).tanh_()",
             "th.copy_(logits[s:e]).add_(SOFTCAP_SHIFT).mul_(1.0 / SOFTCAP_TEMP).tanh_()",
             ["tests/test_kernels.py", "-k", "chunked"],
             "the CPU cross-entropy's tanh softcap at the sigmoid's temperature"),
    Mutation("kernels.py", "v = moment[rows] * torch.exp(missed).float() + step.one_minus_beta2 * ((g * g).sum(1) / g.shape[1])",
             "v = moment[rows] + step.one_minus_beta2 * ((g * g).sum(1) / g.shape[1])", OPTIM,
             "sparse Adam forgets the missed decay"),
    # the config's range checks
    Mutation("machinery/config.py", 'return real(default, "a beta", below=1.0)', 'return real(default, "a beta", high=1.0)',
             CONFIG_CHECKS, "a beta of 1 accepted"),
    Mutation("machinery/config.py", "(below is not None and value >= below)", "(below is not None and value > below)",
             CONFIG_CHECKS, "an open upper bound taken as closed"),
    Mutation("machinery/config.py", "if h.cooldown_end <= h.cooldown_start:", "if h.cooldown_end < h.cooldown_start:",
             CONFIG_CHECKS, "a cooldown that ends where it starts"),
    Mutation("machinery/config.py", "if not 1 <= len(s.mtp_weights) <= MAX_TARGETS - 1", "if not 1 <= len(s.mtp_weights) <= MAX_TARGETS",
             CONFIG_CHECKS, "one multi-token weight too many"),
    Mutation("machinery/config.py", "all(is_number(b) and 0 <= b < 1 for b in value)", "all(is_number(b) and 0 <= b <= 1 for b in value)",
             CONFIG_CHECKS, "Adam's betas accept 1"),
    Mutation("machinery/config.py", "if not is_number(getattr(p, key)) or not 0 <= getattr(p, key) < 1:",
             "if not is_number(getattr(p, key)) or not 0 <= getattr(p, key) <= 1:", CONFIG_CHECKS,
             "a table phase's beta of 1"),
    Mutation("machinery/config.py", "(above is not None and value <= above) or (high is not None and value > high)",
             "(above is not None and value <= above) or (high is not None and value >= high)", CONFIG_CHECKS,
             "a closed upper bound taken as open"),
    # the checkpoint file
    Mutation("machinery/checkpoint.py", "metadata = {k: v for k, v in header.get(\"__metadata__\", {}).items() if k not in HASH_KEYS}",
             "metadata = {k: v for k, v in header.get(\"__metadata__\", {}).items() if k != \"sha256\"}",
             CHECKPOINT_FILE, "the header's hash covers its own data_sha256 placeholder"),
    Mutation("machinery/checkpoint.py", "        whole.update(data)\n        if whole.hexdigest() != expected:",
             "        if whole.hexdigest() != expected:", CHECKPOINT_FILE, "the reader hashes the header alone"),
    Mutation("machinery/checkpoint.py", "if stop - begin != math.prod(shape) * dtype.itemsize:",
             "if stop - begin < math.prod(shape) * dtype.itemsize:", CHECKPOINT_FILE,
             "a byte range larger than its shape accepted"),
    Mutation("machinery/checkpoint.py", "if \"sha256\" not in metadata and not trust:", "if \"sha256\" not in metadata and trust:",
             CHECKPOINT_FILE, "a checkpoint without a header hash loads untrusted"),
    Mutation("machinery/checkpoint.py", "    what = kind(os.stat(path).st_mode)\n", "    what = None\n", CHECKPOINT_FILE,
             "no look at what the path is before opening it"),
    Mutation("evaluation/evaluate.py", "scaled = (logits - logits.max()) / temperature", "scaled = logits.float() / temperature",
             SAMPLING, "sampling divides float32 logits by a tiny temperature"),
    # the records' statistics
    Mutation("records/significance.py", "return all(len(s) >= 2 for s in samples) and any(np.ptp(s) > 0 for s in samples)",
             "return all(len(s) >= 2 for s in samples) and all(np.ptp(s) > 0 for s in samples)", STATISTICS,
             "a Welch test that gives up when one group has no spread"),
    Mutation("records/significance.py", "result = stats.ttest_1samp(values, target, alternative=\"less\")",
             "result = stats.ttest_1samp(values, target, alternative=\"two-sided\")", STATISTICS,
             "the target's t-test two-sided"),
    Mutation("records/significance.py", "\"std\": float(np.std(values, ddof=1)) if len(values) > 1 else None,",
             "\"std\": float(np.std(values)) if len(values) > 1 else None,", STATISTICS, "the population std"),
    Mutation("records/significance.py", "if stats.t.cdf((mean - target) / (std / math.sqrt(n)), n - 1) < threshold:",
             "if stats.t.cdf((mean - target) / (std / math.sqrt(n)), n) < threshold:", STATISTICS,
             "the runs needed counted with a degree of freedom too many"),
    Mutation("records/significance.py", "return (target - float(np.mean(values))) * math.sqrt(len(values))",
             "return (target - float(np.mean(values))) * len(values)", STEPS_TRACK, "the margin rule scaled by n"),
    Mutation("records/significance.py", "return gain / math.sqrt(1 / old[\"n\"] + 1 / new[\"n\"])",
             "return gain / (1 / old[\"n\"] + 1 / new[\"n\"])", STEPS_TRACK, "the pairwise statistic unscaled"),
    # the records' tools
    Mutation("records/rules.py", "            used = data_read(log, key)", "            used = data_read(log, \"val_files\")",
             MAKE_RECORD, "the train data checked by the val pattern"),
    Mutation("records/rules.py", "keys = MACHINE_KEYS + (IDENTITY_KEYS if statistics_format >= FORMAT_WITH_IDENTITY else ())",
             "keys = MACHINE_KEYS", MAKE_RECORD, "a machine known by its name only"),
    Mutation("records/rules.py", "if commit.endswith(DIRTY_MARK):", "if commit.startswith(DIRTY_MARK):",
             MAKE_RECORD, "a dirty tree let through"),
    Mutation("records/rules.py", "        if series.date < day:", "        if series.date <= day:",
             MAKE_RECORD, "a record made on its runs' day refused"),
    Mutation("records/series_stats.py", "    if \"baseline\" in track and base is None:", "    if \"baseline\" in track and base is not None:",
             MAKE_RECORD, "the interleaved rule without baseline runs"),
    Mutation("records/series_stats.py", "        if not base[\"speedup\"] > current[\"speedup\"]:", "        if base[\"speedup\"] < 1.0:",
             MAKE_RECORD, "a speed-up only over 1, not over the current record's"),
    Mutation("records/series_stats.py", "    elif not s[\"train_time_ms\"][\"mean\"] < current[\"mean_train_time_ms\"]:",
             "    elif not s[\"train_time_ms\"][\"mean\"] < 15 * current[\"mean_train_time_ms\"]:", MAKE_RECORD,
             "a record fifteen times slower than the current one"),
    Mutation("records/record_files.py", "missing = [run[\"run_id\"] for run in held if run[\"run_id\"] not in given]",
             "missing = []", MAKE_RECORD, "a not-a-record folder replaced without all of its runs"),
    Mutation("records/record_files.py", "        if len(folders) > 1:", "        if len(folders) > 2:", MAKE_RECORD,
             "a run in two records let through"),
    Mutation("records/checked_records.py", "expected = {\"README.md\": readme_text(s, folder_rel, s[\"runs\"][0][\"log\"]), \"statistics.txt\": statistics_text(s)}",
             "expected = {\"statistics.txt\": statistics_text(s)}", MAKE_RECORD, "a record's README not checked"),
    Mutation("records/checked_records.py", "present = sorted(p.name for p in folder.iterdir() if p.name not in RECORD_FILES)",
             "present = sorted(p.name for p in folder.glob(\"*.txt\") if p.name not in RECORD_FILES)", MAKE_RECORD,
             "a record folder's other files not seen"),
    Mutation("records/record_files.py", "LOG_NAME = re.compile(r\"(?P<run_id>[A-Za-z0-9][A-Za-z0-9_-]*)\\.txt\")",
             "LOG_NAME = re.compile(r\"(?P<run_id>[^/]+?)\\.\\w+\")", MAKE_RECORD, "any log file name"),
    Mutation("records/make_record.py", "    with records_lock(args.records_dir):", "    with contextlib.nullcontext():",
             MAKE_RECORD, "no lock"),
    Mutation("records/record_files.py", "if folder.parent != track_dir.resolve() or not listed_in_record(folder, Path(path).name):",
             "if not folder.is_relative_to(track_dir.parent.resolve()):", MAKE_RECORD,
             "baseline logs from any folder under records/"),
    Mutation("records/rules.py", "if not any(log.declared_sha256 == version for version in versions):",
             "if not any(log.declared_sha256.get(entry) == version.get(entry) for version in versions):", RULES,
             "a baseline known by its entry script alone"),
    Mutation("records/rules.py", "            if first > last:", "            if first > last + datetime.timedelta(days=2):",
             RULES, "a series a day after its baseline runs counted as interleaved"),
    Mutation("records/rules.py", "            seed = repr(log.config.get(\"seed\"))", "            seed = log.run_id", RULES,
             "a seed run twice counted twice"),
    Mutation("records/rules.py", "busy = next((line for line in log.info if line.startswith(BUSY_WARNING)), None)",
             "busy = next((line for line in log.info if line == BUSY_WARNING), None)", RULES,
             "a busy machine's warning missed"),
    Mutation("records/rules.py", "        if committed.get(relpath) != git_blob_id(content):",
             "        if relpath not in committed:", RULES, "a log's sources not compared with its commit's files"),
    Mutation("records/rules.py", "beyond = next(((step, ms) for step, ms in lines if step > steps or ms > final[\"train_time_ms\"]), None)",
             "beyond = next(((step, ms) for step, ms in lines if step > steps), None)", RULES,
             "a step line past the final train time let through"),
    Mutation("records/rules.py", "        if when > series.now:", "        if when > series.now.replace(year=9999):", RULES,
             "a run that started in the future let through"),
    Mutation("records/rules.py", "    return log.code_id, repr(sorted(free_config(log).items()))",
             "    return log.code_id, log.run_id", RULES, "a re-run of a record counted as a new program"),
    Mutation("records/rules.py", "        both = [fp for fp in train if fp[\"path\"] in {v[\"path\"] for v in val}\n"
             "                or data_identity([fp])[0] in data_identity(val)]",
             "        both = [fp for fp in train if fp[\"path\"] in {v[\"path\"] for v in val}]", RULES,
             "the val shard under a train name let through"),
    Mutation("records/readme_tables.py", "    last = max(starts) if s[\"format\"] >= FORMAT_WITH_IDENTITY and all(starts) else iso_time(s[\"made\"])",
             "    last = iso_time(s[\"made\"])", STEPS_TRACK, "the previous record ordered by an editable made"),
    Mutation("records/record_writer.py", "f\"python records/reproduce.py {shlex.quote(f'{folder_rel}/{first_log}')} --run\",",
             "f\"python records/reproduce.py {folder_rel}/{first_log} --run\",", MAKE_RECORD, "a command unquoted"),
    Mutation("records/logfile.py", "            or CONTROL_CHARACTER.search(relpath)):", "            ):", LOG_FORMAT,
             "a NUL in a source path"),
    Mutation("records/logfile.py", "        value = fp.get(key)\n", "        value = fp.get(key, kind())\n", LOG_FORMAT,
             "a data line without its path"),
    Mutation("records/logfile.py", "    clean = all(committed.get(relpath) == git_blob_id(content) for relpath, content in sources)",
             "    clean = all(relpath in committed for relpath, content in sources)", LOG_FORMAT,
             "an edited source at a committed path is clean"),
    Mutation("records/logfile.py", "identity[\"machine_id\"] = hashlib.sha256(MACHINE_ID_SALT + machine_id).hexdigest()[:IDENTITY_HEX_DIGITS]",
             "identity[\"machine_id\"] = machine_id.decode(\"ascii\", \"replace\")[:IDENTITY_HEX_DIGITS]", LOG_FORMAT,
             "the machine id logged in clear"),
    Mutation("records/logfile.py", "        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)   # never waits, even on a FIFO put there since",
             "        fd = os.open(path, os.O_RDONLY)", LOG_FORMAT, "a blocking open after the look"),
    Mutation("records/reproduce.py", "    if \"log_dir\" in config:", "    if \"log_dir\" not in config:", REPRODUCE,
             "the rerun writes where the log said"),
    Mutation("records/reproduce.py", "    records = os.path.realpath(REPO / \"records\")", "    records = os.path.realpath(REPO / \"record\")",
             REPRODUCE, "records/ not guarded"),
    Mutation("records/reproduce.py", "        if out.is_dir() and holds_recreation(out, files):", "        if out.is_dir():",
             REPRODUCE, "any folder taken for the recreation"),
    # what a user or a log hands the tools
    Mutation("records/logfile.py", "        raw = read_regular_file(path, LOG_MAX_BYTES)", "        raw = read_regular_file(path)",
             INPUTS, "a log read whole, whatever its size"),
    Mutation("records/readme_tables.py", "    return re.sub(r\"([\\\\`*_\\[\\]|~])\", r\"\\\\\\1\", text)", "    return text",
             INPUTS, "table cells unescaped"),
    Mutation("records/readme_tables.py", "    if text.count(start) > 1 or text.count(end) > 1 or i < 0 or j < i:",
             "    if i < 0 or j < i:", INPUTS, "a README's second pair of markers taken"),
    Mutation("records/make_record.py", "    except KeyboardInterrupt:", "    except ZeroDivisionError:", INPUTS,
             "Ctrl-C in make_record.py a traceback"),
    Mutation("records/reproduce.py", "elif entry.is_file(follow_symlinks=False) and rel in files and same_bytes(entry.path, files[rel]):",
             "elif entry.is_file(follow_symlinks=False) and same_bytes(entry.path, files.get(rel, b\"\")) and rel in files:",
             INPUTS, "a folder's other files read to tell it from the recreation"),
    Mutation("records/reproduce.py", "    outside = next(((key, p) for key, p in patterns.items() if not inside_data_folder(p)), None)",
             "    outside = None", INPUTS, "a log's glob listed wherever it reaches"),
    Mutation("records/reproduce.py", "    if not 1 <= world_size <= MAX_WORLD_SIZE:", "    if world_size < 0:", INPUTS,
             "world_size 0 passed to torch.distributed.run"),
    Mutation("records/plot.py", "    if out.suffix.lower().lstrip(\".\") not in kinds:", "    if not out.suffix:", INPUTS,
             "plot.py --out x.xyz drawn first"),
    Mutation("evaluation/downstream.py", "    if os.path.lexists(output):", "    if os.path.isdir(output):", RESULTS_FILE,
             "evaluation/downstream.py's results written over the checkpoint"),
    Mutation("evaluation/evaluate.py", "        if not bool(torch.isfinite(logits).all()):", "        if logits.numel() == 0:", NAN_SAMPLE,
             "NaN logits handed to the sampler"),
    Mutation("bench/step_model.py", "    if args.json and (refusal := json_path_refusal(args.json)):",
             "    if args.write and (refusal := json_path_refusal(args.json)):", STEP_MODEL_JSON,
             "--json checked after the census"),
    Mutation("machinery/memory_budget.py", "        if value is not None and not 0 < value <= PLAN_MAX_GIB:",
             "        if value is not None and not (math.isfinite(value) and value > 0):", PLAN_MEMORY,
             "--plan --gpu_gib=1e308 overflows"),
    Mutation("machinery/memory_budget.py", "            return check_cpu_weights(recipe, h, available(pg.device))  # which the CPU's reference path runs",
             "            return None", CPU_MEMORY, "an unpriced CPU run let through to the allocator"),
    # shards and the downloader
    Mutation("data/shards.py", "SHARD_FILE_MODE = 0o644", "SHARD_FILE_MODE = 0o600", SHARDS,
             "shard files readable by their owner only"),
    Mutation("data/shards.py", "    if num_tokens < 0 or size != expected:", "    if num_tokens < 0 or size < expected:", SHARDS,
             "a shard with extra bytes accepted"),
    Mutation("data/cached_fineweb10B.py", "if tokens == HUB_SHARD_TOKENS or (last and 0 < tokens < HUB_SHARD_TOKENS):",
             "if tokens <= HUB_SHARD_TOKENS:", SHARDS, "a shard of any size below the hub's kept"),
    # the memory budget
    Mutation("machinery/memory_budget.py", "\"gradients\": sum(p.nbytes for p in params if p.requires_grad),", "\"gradients\": 0,", MEMORY,
             "the budget leaves out the gradients"),
    Mutation("machinery/memory_budget.py", "return 1 << max(nbytes - 1, 0).bit_length()", "return 1 << nbytes.bit_length()", MEMORY,
             "pinned memory rounded a power of two too far"),
    Mutation("machinery/sparse_tables.py", "return h.model_dim * getattr(torch, h.ngram_dtype).itemsize + NGRAM_ROW_STATE_BYTES",
             "return h.model_dim * getattr(torch, h.ngram_dtype).itemsize", MEMORY, "the n-gram table without its row state"),
    Mutation("machinery/memory_budget.py", "    if pg.device.type == \"cpu\":\n        try:",
             "    if pg.device.type == \"cuda\":\n        try:", CPU_MEMORY,
             "a CPU run checked as a GPU's"),
    # the sparse tables
    Mutation("machinery/sparse_tables.py", "largest=False).indices", "largest=True).indices", SPARSE,
             "the host cache evicts the most recently used rows"),
    Mutation("machinery/sparse_tables.py", "candidate = (self.row_of >= 0) & ~self.pinned", "candidate = self.row_of >= 0", SPARSE,
             "the host cache evicts rows a slice still needs"),
    Mutation("machinery/sparse_tables.py", "first = rows[order[:1]]", "first = rows[order[-1:]]", SPARSE,
             "the value tables' untouched candidates stand in as touched rows"),
    Mutation("machinery/sparse_tables.py", "slot = torch.where(new, self.count + new.cumsum(0) - 1, slot)",
             "slot = torch.where(new, self.count + new.cumsum(0), slot)", MEMORY,
             "the row sums' new slots one late"),
    Mutation("machinery/sparse_tables.py", "            travelling = summed.to(adam.table.dtype)", "            travelling = summed",
             TRAVEL, "the value tables' sums all-reduced in fp32"),
    Mutation("machinery/sparse_tables.py", "sent = self.sum_rows(grads, groups, scale=1.0 / self.pg.world_size,",
             "sent = self.sum_rows(grads, groups, scale=1.0,", TRAVEL,
             "a split table's gradients not divided by the processes"),
    Mutation("machinery/sparse_tables.py", "    if h.ngram_rows % pg.world_size:", "    if h.ngram_rows % pg.world_size > 1:", UNEVEN_SPLIT,
             "a table split unevenly across two processes"),
    # processes
    Mutation("machinery/processes.py", "INTERRUPTING_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)",
             "INTERRUPTING_SIGNALS = (signal.SIGINT, signal.SIGTERM)", HANGUP, "a closed terminal ends the run unlogged"),
    Mutation("machinery/processes.py", "local_rank = _whole_variable(environ, \"LOCAL_RANK\", 0, 0, local_world_size - 1,",
             "local_rank = _whole_variable(environ, \"LOCAL_RANK\", 0, 0, local_world_size,", LAUNCH,
             "LOCAL_RANK one past its machine's processes"),
    Mutation("machinery/processes.py", "    if not 0 < timeout <= 1e6:", "    if not 0 <= timeout <= 1e6:", LAUNCH,
             "a rendezvous timeout of 0 s"),
    # the persistent descriptor FP8 GEMMs (the interpreter runs them) and their split-K plan
    Mutation("kernels.py", "        b = b_desc.load([tile_n * BLOCK_N, step * BLOCK_K])",
             "        b = b_desc.load([tile_m * BLOCK_N, step * BLOCK_K])", TMA_GEMM,
             "the descriptor GEMM loads B at the row tile's offset"),
    Mutation("kernels.py", "    k_hi = tl.where(split, (j + 1) * k_steps // split_k, k_steps)",
             "    k_hi = tl.where(split, (j + 1) * k_steps // split_k - 1, k_steps)", TMA_GEMM,
             "each split-K range one K step short"),
    Mutation("kernels.py", "    for j in range(0, split_k):", "    for j in range(1, split_k):", TMA_GEMM,
             "the split-K reduction drops the first range's partial"),
    Mutation("kernels.py", "            act = tl.trans(act_desc.load([tile_n * BLOCK_N, tile_m * BLOCK_M])).to(tl.float32)",
             "            act = tl.trans(act_desc.load([tile_m * BLOCK_N, tile_n * BLOCK_M])).to(tl.float32)",
             TMA_EPILOGUES, "the relu2 gradient epilogue reads another tile's activation"),
    Mutation("kernels.py", "    full = tiles // sm_count * sm_count", "    full = tiles // sm_count", SPLIT_PLAN,
             "the split-K plan counts waves as tiles"),
    # the one-kernel attention backward (the interpreter runs it)
    Mutation("kernels.py", "            visible_t = (cols[:, None] <= rows[None, :]) & (rows[None, :] - cols[:, None] < window) & \\\n"
             "                (rows[None, :] < col_end[:, None])\n            s_t = tl.where(visible_t, s_t, -float(\"inf\"))\n"
             "        p_t = tl.exp2(s_t - lse[None, :])\n        dv += tl.dot(p_t.to(do.dtype), do)\n        dp_t = tl.dot(v, tl.trans(do))\n"
             "        ds_t = (p_t",
             "            visible_t = (cols[:, None] <= rows[None, :]) & (rows[None, :] - cols[:, None] < window)\n"
             "            s_t = tl.where(visible_t, s_t, -float(\"inf\"))\n"
             "        p_t = tl.exp2(s_t - lse[None, :])\n        dv += tl.dot(p_t.to(do.dtype), do)\n        dp_t = tl.dot(v, tl.trans(do))\n"
             "        ds_t = (p_t", FUSED_ATTENTION, "the one-kernel backward lets a query see an earlier document's keys"),
    Mutation("kernels.py", "        dq = tl.dot(tl.trans(ds_t), k) * sm_scale", "        dq = tl.dot(tl.trans(ds_t), k)",
             FUSED_ATTENTION, "the one-kernel backward's dQ misses the softmax scale"),
    Mutation("kernels.py", "            o = tl.load(o_ptrs)\n            lse = tl.load(lse_ptr + rows)\n"
             "        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)",
             "            o = tl.load(o_ptrs)\n            lse = tl.load(lse_ptr + rows)\n"
             "        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=0)", FUSED_ATTENTION,
             "the one-kernel backward's delta summed over the wrong axis"),
    # the descriptor attention variants (the interpreter runs their descriptor loads and bounds)
    Mutation("kernels.py", "        v = v_desc.load([key_first, 0])", "        v = v_desc.load([key_first + 1, 0])",
             DESCRIPTOR_ATTENTION, "the descriptor forward reads each V tile one token late"),
    Mutation("kernels.py", "window, qk_scale, lo, hi, BLOCK_N, True, WARP_SPECIALIZE)",
             "window, qk_scale, lo, hi, BLOCK_N, False, WARP_SPECIALIZE)", DESCRIPTOR_ATTENTION,
             "the descriptor forward masks no tile"),
    Mutation("kernels.py", "        do = do_desc.load([query_first, 0])", "        do = do_desc.load([query_first + 1, 0])",
             DESCRIPTOR_ATTENTION, "the descriptor backward reads each dO tile one token late"),
    Mutation("kernels.py", "            seen = (cols[:, None] <= rows[None, :]) & (rows[None, :] - cols[:, None] < window) & \\\n"
             "                (rows[None, :] < col_end[:, None])\n",
             "            seen = (cols[:, None] <= rows[None, :]) & (rows[None, :] - cols[:, None] < window)\n",
             DESCRIPTOR_ATTENTION, "the descriptor backward lets a query see an earlier document's keys"),
    Mutation("kernels.py", "    dk_desc.store([k_first, 0], (dk * sm_scale).to(dk_desc.dtype))",
             "    dk_desc.store([k_first, 0], dk.to(dk_desc.dtype))", DESCRIPTOR_ATTENTION,
             "the descriptor backward's dK misses the softmax scale"),
    # the choice of implementation, and the step model's structure prices
    Mutation("machinery/kernel_choice.py", "    index = min(range(len(timed)), key=lambda i: decision.ms[timed[i].name]) if timed else -1",
             "    index = max(range(len(timed)), key=lambda i: decision.ms[timed[i].name]) if timed else -1",
             KERNEL_CHOICE, "the selection keeps the slowest candidate"),
    Mutation("machinery/kernel_choice.py", "    return _STATE.agree(mine) if _STATE.agree is not None else mine", "    return mine",
             KERNEL_CHOICE, "each process keeps its own timing's choice, not rank 0's"),
    Mutation("bench/step_model.py", "    if fast:\n        return share\n    block_k", "    if True:\n        return share\n    block_k",
             STRUCTURE_PRICES, "promoted accumulation priced as fast"),
    # a compiled model's FP8 casts, XSA in the heads' dtype
    Mutation("kernels.py", "amax.copy_(torch.maximum(amax, x.abs().amax(dim=-1).amax().float().reshape(1)))",
             "amax.copy_(torch.maximum(amax, x[0].abs().amax().float().reshape(1)))", FUSED_CASTS,
             "the fused cast's amax from the first row only"),
    Mutation("kernels.py", "    return q, transpose(q, config)", "    return q, q", FUSED_CASTS,
             "the fused cast's second copy not transposed"),
    Mutation("train_gpt.py", "    along = (y * direction).sum(-1, keepdim=True).type_as(y)",
             "    along = (y * direction).sum(-1, keepdim=True)", XSA_DTYPE,
             "XSA's output in fp32 under CUDA autocast"),
    Mutation("train_gpt.py", "        return None if self.sa_lambdas is None else self.sa_lambdas[0]", "        return None",
             MODEL, "the dense trunk's QKV scale left off the values"),
    # the record presets' schedules and optimizer details
    Mutation("train_gpt.py", "    if h.anvil_fast_beta_follows_mu and anvil_blend(h, step) == 1.0:",
             "    if h.anvil_fast_beta_follows_mu and step == 0:", RECORD_SCHEDULES,
             "the fast rail at mu only at step 0"),
    Mutation("train_gpt.py", "        progress = min(int(progress * n), n - 1) / max(n - 1, 1)",
             "        progress = min(int(progress * n), n - 1) / n", RECORD_SCHEDULES,
             "the prefix weight's levels short of their end"),
    Mutation("train_gpt.py", "    beta1 = h.value_embed_betas[0] if p.value_embed_beta1 is None else p.value_embed_beta1",
             "    beta1 = h.value_embed_betas[0]", RECORD_SCHEDULES, "a table phase's value-embedding beta1 ignored"),
    Mutation("train_gpt.py", "    return h.adam_eps / (h.stages[stage_index(h, step)].tokens_per_rank * steps_per_update)",
             "    return h.adam_eps / h.stages[stage_index(h, step)].tokens_per_rank", VALUE_ADAM,
             "eps at the summed scale without the update's steps"),
    Mutation("machinery/sampled_softmax.py", "    return (start + torch.where(need > 0, draw, 0)) % V",
             "    return (start + draw) % V", RECORD_SCHEDULES, "the walk moves when no negative was drawn"),
    Mutation("optim.py", "        return step >= self.N - average.window and ((self.N - 1 - step) % average.every == average.offset",
             "        return step >= self.N - average.window and ((self.N - 1 - step) % average.every == 0",
             RECORD_SCHEDULES, "an average's offset ignored"),
    Mutation("train_gpt.py", '        lanes = (None,) * (len(splits) - 1) + ("rows",) if value_rows else None',
             "        lanes = None", MATRIX_SHAPES, "a narrow-value layer's values equalized by columns"),
    Mutation("optim.py", '        m.lerp_(g, hyper["one_minus_beta1"])', '        m.lerp_(g, 1 - group["betas"][0])',
             OPTIM, "Adam's beta1 baked into a captured update"),
    Mutation("train_gpt.py", '               weight_decay=h.gate_mlp_wd if decayed else 0.0,',
             '               weight_decay=h.gate_mlp_wd,', ADAM_GROUPS, "the gate MLPs' biases and scale decayed"),
    Mutation("train_gpt.py", '        dict(name="post_scales", params=post, lr=h.post_scale_lr, betas=h.scale_betas, weight_decay=0.0),',
             '        dict(name="post_scales", params=post, lr=h.resid_scale_lr, betas=h.scale_betas, weight_decay=0.0),',
             ADAM_GROUPS, "the output scales at the residual scales' LR"),
    Mutation("machinery/resume.py", '    trainer.walk.copy_(state["walk"])', "    pass", RESUME,
             "a resumed run's candidate walk back at its start"),
    Mutation("machinery/resume.py", "        adam.load_state_dict(saved)", "        pass", RESUME,
             "a resumed run's sparse tables without their Adam state"),
    Mutation("machinery/resume.py", "    trainer.advance_to(max(step - 1, 0))", "    trainer.advance_to(step)", RESUME,
             "a resumed run's schedule put at its step before its state is loaded"),
    Mutation("machinery/resume.py", '    return (all(getattr(opt, "pending_calls", 0) == 0 for opt in trainer.optimizers)',
             "    return (True", RESUME, "a resume state written while an Adam holds gradients"),
    Mutation("train_gpt.py", "    for done in range(step):\n        loader.next_batch(*batch_shape(h, done), mine=())",
             "    for done in range(0):\n        loader.next_batch(*batch_shape(h, done), mine=())", RESUME,
             "a resumed run's loader back at the first batch"),
    Mutation("machinery/config.py", "    return text.startswith(SECTION_MARK) and text.endswith(SECTION_MARK)", "    return False", HELP,
             "a schema heading read as the next key's meaning"),
    Mutation("machinery/config.py", "    for item in joined_values(items):", "    for item in items:", ARGUMENTS,
             "--key value refused"),
    Mutation("machinery/memory_budget.py", '        return ["--preset", "cpu", *argv]', "        return argv", ARGUMENTS,
             "train_gpt.py without --preset on a CPU runs the speedrun preset"),
    Mutation("machinery/progress.py", "        validations = sum(1 for at in self.validations if at >= step)",
             "        validations = sum(1 for at in self.validations if at > step)", TIME_LEFT,
             "the time left misses the validation at the reported step"),
    Mutation("machinery/progress.py", "        return training + validations * self.slices * self.seconds_per_slice(per_token)",
             "        return training", TIME_LEFT, "the time left counts the training steps alone"),
    Mutation("machinery/warm_up.py", '            say(f"validation forward {len(seen)}/{warm_up_validations(recipe, h)}")\n', "",
             TIME_LEFT, "the warm-up's validation forwards unannounced"),
    Mutation("train_gpt.py", '                sink.scalars(step, {"val/loss": val_loss})\n', "", SINK,
             "the val loss not mirrored to the metrics sink"),
    Mutation("requirements/train.txt", "numpy==2.4.6\n", "numpy==2.4.6\ntriton==3.7.1\n", INSTALL,
             "a CPU-only training install pulls triton"),
    Mutation("kernels.py", "except ImportError:                # a CPU-only install",
             "except NameError:                # a CPU-only install", INSTALL,
             "kernels.py needs triton on a CPU"),
    # the loss unit: data on the device, each stage's in its captured step, rewritten after a load
    Mutation("train_gpt.py", "upstream = self.loss_unit if exact else 1.0 / x.size(0)",
             "upstream = self.loss_unit_value if exact else 1.0 / x.size(0)", LOSS_UNIT,
             "the cross-entropy's upstream gradient a host number a captured step keeps"),
    Mutation("train_gpt.py", "        self.register_load_state_dict_post_hook(GPT.forget_loss_unit)", "", LOSS_UNIT,
             "restored FP8 states keep the loss unit they were saved with"),
    # the memory budget's step at the stage that peaks
    Mutation("machinery/memory_budget.py", "key=lambda index: stage_memory(recipe, config_json, index)[0])",
             "key=lambda index: h.stages[index].tokens_per_rank * (h.stages[index].candidates or PADDED_VOCAB_SIZE))",
             PEAK_STAGE, "the peak stage ranked by tokens times head width"),
    Mutation("machinery/memory_budget.py", "        if steps and key not in seen:", "        if steps and not seen:", PEAK_STAGE,
             "the budget's step measured at the first stage alone"),
    # a host table's write-back under --sync_check
    Mutation("machinery/sparse_tables.py", "        with syncs_allowed():\n            synchronize(self.device)",
             "        with contextlib.nullcontext():\n            synchronize(self.device)", WRITE_BACK,
             "the write-back's waits inside --sync_check's error mode"),
    Mutation("machinery/sparse_tables.py", "        for host, values in zip((self.table.table, self.moment, self.last), staged):",
             "        for host, values in zip((self.table.table, self.last, self.moment), staged):", WRITE_BACK,
             "the written-back moments and last events swapped"),
    # first contact: the compiled run's stages and untie, its caps, its caches, its warm-up's parts
    Mutation("bench/first_contact.py", "COMPILED_STAGES = dict(gpu=((2, 8), (4, 4)), dry=((0, 2), (1, 2)))",
             "COMPILED_STAGES = dict(gpu=((2, 8), (3, 4)), dry=((0, 2), (1, 2)))", FIRST_CONTACT,
             "the compiled run's stages of one micro-batch size"),
    Mutation("bench/first_contact.py", "UNTIE_STEP = dict(gpu=10, dry=3)", "UNTIE_STEP = dict(gpu=8, dry=3)",
             FIRST_CONTACT, "the untie at the second stage's first step"),
    Mutation("bench/first_contact.py", "START_UP_S = 120 ", "START_UP_S = 200 ", FIRST_CONTACT,
             "no room for a second call with a slow start-up"),
    Mutation("bench/first_contact.py", "    for lean in (False, True):", "    for lean in (False,):", FIRST_CONTACT,
             "an archive too large to come back kept whole"),
    Mutation("bench/first_contact.py", "where = f\"at step {steps[-1][0]}\" if steps else f\"in the warm-up, {where}\"",
             "where = f\"at step {steps[-1][0]}\" if steps else \"in the warm-up\"", FIRST_CONTACT,
             "a run stopped in its warm-up does not say where"),
    Mutation("machinery/warm_up.py", "    for k, step in enumerate(keys if h.warmup_steps and trainer.graphs.capturing else ()):",
             "    for k, step in enumerate(keys[:1] if h.warmup_steps and trainer.graphs.capturing else ()):",
             CAPTURES, "the warm-up captures the first graph key only"),
    Mutation("machinery/warm_up.py", "    log.write(f\"{WARM_UP_PART}{what}: {time.perf_counter() - start:.1f} s,",
             "    log.write(f\"{what}: {time.perf_counter() - start:.1f} s,", FIRST_CONTACT_DRY,
             "the warm-up's parts logged without their marker"),
    # PR 371's approximate backward: the truncated attention backward, the chooser, the sampled head gradient
    Mutation("kernels.py", "        window = tl.minimum(window, tl.load(head_window_ptr + head))",
             "        window = tl.load(head_window_ptr + head)", TRUNCATED_KERNELS,
             "a head's backward window wider than the forward's reaches past it"),
    Mutation("kernels.py", "            kept = p * (distance[None] < head_windows.long()[:, None, None])",
             "            kept = p * (distance[None] <= head_windows.long()[:, None, None])", TRUNCATED_REFERENCE,
             "the reference's truncated backward keeps one key too many"),
    Mutation("machinery/backward_windows.py", "        chosen = torch.where(errors[row].cpu() <= bound, candidates[row], chosen)",
             "        chosen = torch.where(errors[row].cpu() < bound, candidates[row], chosen)", WINDOW_CHOOSER,
             "a window exactly at the error bound refused"),
    Mutation("machinery/backward_windows.py", "        worst = error if worst is None else torch.maximum(worst, error)",
             "        worst = error", WINDOW_CHOOSER, "a head's error from dV alone"),
    Mutation("kernels.py", "    return groups * stride + offsets", "    return groups * stride", SAMPLED_HEAD,
             "the head gradient always samples a group's first row"),
    Mutation("kernels.py", "            grad_w = (grad_y.index_select(0, rows).t() @ x.index_select(0, rows).to(dtype)) * ctx.stride",
             "            grad_w = grad_y.index_select(0, rows).t() @ x.index_select(0, rows).to(dtype)", SAMPLED_HEAD,
             "the sampled head gradient not scaled by the stride"),
    Mutation("kernels.py", "    w_scale_g = g_scale if stride == 1 else g_scale * stride", "    w_scale_g = g_scale",
             SAMPLED_FP8, "the FP8 head's sampled weight gradient not scaled by the stride"),
    Mutation("train_gpt.py", "    sampled = h.head_grad_stride > 1 and h.head_grad_start <= step < end",
             "    sampled = h.head_grad_stride > 1 and h.head_grad_start <= step <= end", APPROX_SCHEDULE,
             "the sampled head gradient runs into the exact last steps"),
    Mutation("train_gpt.py", "        sample = self.head_sample(x.size(0))", "        sample = None", APPROX_STATEMENT,
             "the model's head never samples its weight gradient"),
    Mutation("machinery/backward_windows.py", "            blocks[i].attn.set_backward_windows(windows)",
             "            blocks[i].attn.set_backward_windows(windows * 0)",
             WINDOW_TRAINER, "the trainer drops the chosen windows: every head stays exact"),
    Mutation("machinery/ngram_table.py", "        return ids[context.long()]\n", "        return context\n", MODEL,
             "the n-gram hashes read the raw tokens where ngram_normalized asks for their normalized ids"),
    Mutation("machinery/ngram_table.py", "signs[trigram_sign_rows(ids, is_start, self.record_hashes)[seen:]])",
             "signs[trigram_sign_rows(context, is_start, self.record_hashes)[seen:]])", MODEL,
             "the trigram sign rows from the raw tokens, the rows from the normalized ones"),
    Mutation("data/tokenizer.py", 'return "".join(ch for ch in text.casefold() if ch.isalnum())',
             'return "".join(ch for ch in text.casefold() if not ch.isspace())',
             ["tests/test_data.py", "-k", "normalized"], "the normalized text keeps punctuation"),
    # the pointer mixture (PR 379)
    Mutation('kernels.py', '    visible = (key_pos[:, None, :] < qpos) & (key_pos[:, None, :] >= first)',
             '    visible = (key_pos[:, None, :] <= qpos) & (key_pos[:, None, :] >= first)', POINTER, 'the pointer reference lets a query point at itself'),
    Mutation('kernels.py', '    return torch.clamp((positions // band - 1) * band, min=0)',
             '    return torch.clamp((positions // band) * band, min=0)', POINTER, "the pointer's band leaves out the block before the query's"),
    Mutation('kernels.py', '    starts = (tokens == bos) | (positions == 0)',
             '    starts = positions == 0', POINTER, 'the pointer points across documents'),
    Mutation('kernels.py', '    total = e.sum(-1, keepdim=True) + e0',
             '    total = e.sum(-1, keepdim=True)', POINTER, 'the pointer reference leaves the sink out of its normalizer'),
    Mutation('kernels.py', '    hit = key_tok[:, None, :] == padded(targets, -1).view(blocks, L, 1)',
             '    hit = key_tok[:, None, :] == padded(tokens, -1).view(blocks, L, 1)', POINTER, "the pointer's mass is on the query's own token, not its target"),
    Mutation('kernels.py', '    mixed = p_lm * (1.0 - alpha * (1.0 - a_sink)) + alpha * p_copy',
             '    mixed = p_lm * (1.0 - alpha) + alpha * p_copy', POINTER, "the mixture does not give the sink's mass back to the LM"),
    Mutation('kernels.py', '    lse_lm = torch.logsumexp(z.masked_fill(is_copy, float("-inf")), dim=-1)',
             '    lse_lm = lse', POINTER, "the mixture's LM is not renormalized over the real columns"),
    Mutation('kernels.py', '    losses = torch.cat([mixture[:, None].to(losses), losses[:, 1:]], dim=1)',
             '    losses = torch.cat([losses[:, :1], losses[:, 1:]], dim=1)', POINTER, 'the objective keeps the plain next-token cross-entropy'),
    Mutation('kernels.py', '        hit = hit * alpha + tl.sum(tl.where(tok[None, :] == tgt[:, None], p, 0.0), axis=1)',
             '        hit = hit + tl.sum(tl.where(tok[None, :] == tgt[:, None], p, 0.0), axis=1)', POINTER_KERNEL, "the pointer kernel's target mass is not rescaled with the running max"),
    Mutation('kernels.py', '    hi = tl.minimum(tl.minimum(tl.load(end_ptr + last), (last // band + 2) * band), T)',
             '    hi = tl.minimum(tl.minimum(tl.load(end_ptr + last), (last // band + 1) * band), T)', POINTER_KERNEL, "the pointer's dK kernel stops a band block early"),
    Mutation('kernels.py', '        return dq.to(q.dtype), dk.to(k.dtype), a * (g_a - delta), None, None, None, None, None, None',
             '        return dq.to(q.dtype), dk.to(k.dtype), a * g_a, None, None, None, None, None, None', POINTER_KERNEL, "the sink score's gradient misses the normalizer's share"),
    Mutation('train_gpt.py', '        q = self.query_gain.type_as(x) * rms_norm(F.linear(x, self.query.type_as(x)))',
             '        q = rms_norm(F.linear(x, self.query.type_as(x)))', POINTER, "the pointer's query gain is left out"),
    Mutation('train_gpt.py', '        k = rms_norm(F.linear(x, self.key.type_as(x)))',
             '        k = F.linear(x, self.key.type_as(x))', POINTER, "the pointer's keys are not RMS-normed"),
    Mutation('train_gpt.py', '        sink_scores = (q.float() @ self.sink_key.float()) * self.query.shape[0] ** -0.5',
             '        sink_scores = q.float() @ self.sink_key.float()', POINTER, "the sink's score misses the 1/sqrt(D) scale"),
    Mutation('train_gpt.py', '            p_copy, a_sink = self.pointer(x, tokens, targets[:, 0], self.pointer_val_band)',
             '            p_copy, a_sink = self.pointer(x, tokens, targets[:, 0], self.pointer_band)', POINTER, 'validation points with the training band'),
    Mutation("machinery/sampled_softmax.py", '    return (columns < POINTER_COPY_ID).sum()',
             '    return POINTER_COPY_ID', POINTER, 'the sampled softmax reads the gate from the <copy> id, not its column'),
    Mutation('train_gpt.py', '        always = (POINTER_COPY_ID,) if getattr(forward, "pointer", None) is not None else ()',
             '        always = ()', POINTER_TRAINER, "a sampled step's candidates may miss the <copy> slot"),
    Mutation('train_gpt.py', '        dict(name="pointer", params=[model.pointer.query, model.pointer.key] if model.pointer is not None else [],',
             '        dict(name="pointer", params=[model.pointer.query] if model.pointer is not None else [],', POINTER_TRAINER, "the pointer's key projection is never updated"),
    Mutation('kernels.py', '        weight_total = weight_total - w0 - w0 * (g_y + g_c)',
             '        weight_total = weight_total - w0 * (g_y + g_c)', POINTER_CE, 'the mixture kernel keeps the plain next-token softmax share'),
    Mutation('kernels.py', '        copy_weight = -w0 * g_c',
             '        copy_weight = 0.0', POINTER_CE, "the mixture kernel's gradient misses the <copy> column's term"),
    Mutation('kernels.py', '        tl.store(d_a_sink_ptr + row, -w0 * alpha * p_full * r * inv)',
             '        tl.store(d_a_sink_ptr + row, -w0 * alpha * p_full * inv)', POINTER_CE, "the mixture kernel's a_sink derivative misses 1 / (1 - a)"),
    Mutation("kernels.py", "        grad_x, grad_w = _fp8_linear_grads(ctx, saved, g8, g8_t, g_scale, ctx.stride)\n        upstream",
             "        grad_x, grad_w = _fp8_linear_grads(ctx, saved, g8, g8_t, g_scale)\n        upstream",
             [APPROX, "-k", "pointer_heads"], "the pointer mixture's FP8 head drops the sampled gradient's stride"),
    # the document copy feature (PR 378): the keys, the match, its causality, the count bucket, the injection
    Mutation("kernels.py", "    return torch.cat([ones, multipliers.cumprod(0)])",
             "    return torch.cat([multipliers[:1], multipliers.cumprod(0)])", COPY_DEFINITION,
             "the copy keys' hash weighs the newest token by M, not 1"),
    Mutation("kernels.py", "    history = y.unfold(0, longest, 1).flip(1)", "    history = y.unfold(0, longest, 1)",
             COPY_MATCH, "the reference's windows read the oldest tokens of each position's history"),
    Mutation("kernels.py", "        crossed = crossed | (inside & (x == bos))", "        crossed = inside & (x == bos)",
             COPY_KERNEL, "the keys kernel forgets a BOS once its window has passed it: windows leave the document"),
    Mutation("kernels.py", "        power = power * hash_mul", "        power = power * hash_mul * hash_mul", COPY_KERNEL,
             "the keys kernel's powers of M skip every other one"),
    Mutation("kernels.py", "        inside = positions - L + 1 >= doc_start",
             "        inside = positions - L + 1 >= 0", COPY_DEFINITION,
             "the reference keys windows that cross the document's start (the matches cannot tell: such a window "
             "holds the document's BOS at an offset no other window of the document has)"),
    Mutation("kernels.py", "    candidate = torch.where(longest > 0, tokens.long()[(latest + 1).clamp(0, T - 1)], -1)",
             "    candidate = torch.where(longest > 0, tokens.long()[latest.clamp(0, T - 1)], -1)", COPY_MATCH,
             "the candidate is the match's last token, not the token after it"),
    Mutation("kernels.py", "    previous = torch.cat([position.new_full((1,), -1), torch.where(same, position[:-1], -1)])",
             "    previous = torch.cat([torch.where(same, position[1:], -1), position.new_full((1,), -1)])", COPY_MATCH,
             "each key's match is the entry after it in the sorted order (a later position)"),
    Mutation("kernels.py", "    matched = (previous >= 0) & (previous < t)", "    matched = previous >= 0", COPY_CAUSAL,
             "a match need not end before t: a window that leaves the document matches its own position"),
    Mutation("kernels.py", "(longest - 1) * COPY_COUNTS + count.clamp(1, COPY_COUNTS), 0)",
             "(longest - 1) * COPY_COUNTS + (count + 1).clamp(1, COPY_COUNTS), 0)", COPY_MATCH,
             "the count bucket counts the position itself among the earlier matches"),
    Mutation("kernels.py", "    longest = torch.where(matched, torch.arange(1, lengths + 1, device=keys.device)[:, None], 0).amax(0)",
             "    longest = torch.where(matched, torch.arange(1, lengths + 1, device=keys.device)[:, None], 0).amax(0).clamp(max=1)",
             COPY_MATCH, "the shortest matching length wins"),
    Mutation("train_gpt.py", "            x = x + self.document_copy.gains[0] * copied",
             "            x = x + self.document_copy.gains[1] * copied", COPY_MODEL,
             "the copy vector enters the input at the final norm's gain"),
    Mutation("train_gpt.py", "        return rms_norm(x if copied is None else x + self.document_copy.gains[1] * copied)",
             "        return rms_norm(x)", COPY_VALIDATION, "the copy vector never reaches the final norm"),
    Mutation("train_gpt.py", "        return torch.where(bucket[:, None] > 0, v, 0.0)", "        return v", COPY_MODEL,
             "positions without a match get bucket 0's vector"),
    Mutation("train_gpt.py", '        self.register_buffer("normalized", normalized_ids(), persistent=False)',
             '        self.register_buffer("normalized", torch.arange(PADDED_VOCAB_SIZE), persistent=False)', COPY_MODEL,
             "the copy feature matches raw ids, not normalized ones"),
    Mutation("train_gpt.py", "            history = tokens if cache is None or cache.length == 0 else torch.cat([cache.tokens, tokens])",
             "            history = tokens", COPY_CACHE, "generation matches only among the new tokens, not the cached document"),
    Mutation("train_gpt.py", '        dict(name="document_copy", params=copied, lr=h.document_copy_lr,',
             '        dict(name="document_copy", params=copied[:2], lr=h.document_copy_lr,', COPY_GROUP,
             "the copy feature's site gains are never updated"),
    Mutation("machinery/sampled_softmax.py", "        is_target.narrow(0, i, 1).fill_(True)", "        is_target[i] = True",
             FRONTIER_REPLAYS, "the forced <copy> candidate copied from a new host tensor every step"),
    Mutation("kernels.py", "t = ex.index_fill_(1, copy_col, 0.0).sum(dim=1, keepdim=True)",
             "t = ex.sum(dim=1, keepdim=True)", CHUNKED_MIXTURE, "the CPU mixture's LM normalizer counting <copy>"),
    Mutation("kernels.py", "a = a + w0[s:e] + w0_v[s:e] * total / (t * n)", "a = a + w0[s:e]", CHUNKED_MIXTURE,
             "the CPU mixture's softmax coefficient without its pointer term"),
    Mutation("kernels.py", "(-w0 * e_c * e_y / n)[:, 0]", "(-w0 * e_c * t_rows / n)[:, 0]", CHUNKED_MIXTURE,
             "the CPU mixture's a_sink gradient with p_copy's numerator"),
    Mutation("kernels.py", "ex.index_add_(1, copy_col, (w0[s:e] * -slope)", "ex.index_add_(1, copy_col, (w0[s:e] * slope)",
             CHUNKED_MIXTURE, "the CPU mixture's <copy> column gradient with the wrong sign"),
    Mutation("records/logfile.py", "        others = (load - load_at_start * decay) / (1 - decay) - run_threads",
             "        others = load - run_threads * (1 - decay)", ["tests/test_run_report.py", "-k", "other_work"],
             "the load of a run that ended before this one counted as other work"),
    Mutation("kernels.py", "        stages = FP8_TMA_PROMOTED_SPLIT_STAGES if config is FP8_TMA_PROMOTED else FP8_TMA_SPLIT_STAGES",
             "        stages = FP8_TMA_SPLIT_STAGES", ["tests/test_kernels.py", "-k", "promoted_gemms"],
             "a split launch of the promoted tile with three stages (past the shared memory)"),
    Mutation("kernels.py", "GROUP_M=config.group_m, EVEN_K=a.shape[1] % config.block_k == 0)",
             "GROUP_M=config.group_m, EVEN_K=a.shape[1] % 128 == 0)", ["tests/test_kernels.py", "-k", "promoted_tile"],
             "the pointer kernel's K tail left unmasked where K is a multiple of 128 but not of its K step"),
    Mutation("bench/step_model.py", "    return share / (1 + (structures.promotion_cost - 1) * PROMOTION_COST_K / block_k)",
             "    return share / structures.promotion_cost", ["tests/test_step_model.py", "-k", "public_figures"],
             "the step model pricing a promotion every 256 products as one every 128"),
    Mutation("bench/inductor_census.py", "    tiny = sum(elements.get(name, TINY_ELEMENTS + 1) <= TINY_ELEMENTS for name in runs)",
             "    tiny = sum(elements.get(name, TINY_ELEMENTS + 1) < TINY_ELEMENTS for name in runs)",
             ["tests/test_step_model.py", "-k", "inductor_census"], "a kernel of TINY_ELEMENTS elements not counted as tiny"),
    Mutation("kernels.py", "EVEN=m % config.block_m == 0 and n % config.block_k == 0, ADD_INPUT=beta != 0.0)",
             "EVEN=m % config.block_m == 0 and n % config.block_k == 0, ADD_INPUT=beta > 0.0)",
             ["tests/test_kernels.py", "-k", "xxt_with_beta"], "the Gram polynomial drops a negative b A"),
    Mutation("kernels.py", "    acc = acc * alpha\n", "\n",
             ["tests/test_kernels.py", "-k", "xxt_with_beta"], "the Gram polynomial's c not applied"),
    Mutation("optim.py", "    return _batched(torch.baddbmm, X, B, X, beta=a)", "    return _batched(torch.baddbmm, X, B, X, alpha=a)",
             ["tests/test_optim.py", "-k", "orthogonalize_matches_svd or add_product"],
             "a Newton-Schulz step scales B X by a instead of X"),
    Mutation("kernels.py", "        if RULE >= 2:", "        if RULE > 2:",
             ["tests/test_kernels.py", "-k", "fp8_cast_weights_equals"], "the weight groups' exact rule never exact"),
    Mutation("kernels.py", "    tl.store(state + amax_slot, 0.0)\n", "\n",
             ["tests/test_kernels.py", "-k", "fp8_cast_weights_equals"],
             "the weight groups' amax slot not cleared before the cast records"),
    Mutation("kernels.py", "    offset = layer.to(tl.int64) * M * N", "    offset = layer.to(tl.int64) * N",
             ["tests/test_kernels.py", "-k", "fp8_cast_weights_equals"], "a weight group's layers written overlapping"),
    Mutation("train_gpt.py", "            casts = (fp8_weights or {}).get(self.fp8_key)", "            casts = None",
             ["tests/test_model.py", "-k", "casts_the_fp8"], "an MLP casts its own weights again"),
    Mutation("train_gpt.py", "        weight_cast = (args.fp8_weights or {}).get(self.fp8_key)",
             "        weight_cast = None",
             ["tests/test_model.py", "-k", "casts_the_fp8"], "a QKV projection casts its own weight again"),
    Mutation("bench/step_model.py", "                  kernels=3 if exact else 2, **_storages(event))",
             "                  kernels=1, **_storages(event))",
             ["tests/test_step_model.py", "-k", "weight_group"], "a weight group's cast priced as one launch"),
    Mutation("bench/step_model.py",
             "            reads[0] = (reads[0][0], min(reads[0][1], sum(_tensor_bytes(t) for t in outputs)))",
             "            reads[0] = (reads[0][0], reads[0][1])",
             ["tests/test_step_model.py", "-k", "gather"], "a gather priced as a read of its whole table"),
    Mutation("kernels.py", "        return 2 * rows + head % 2", "        return 2 * rows + head // 2",
             ["tests/test_kernels.py", "-k", "qk_norm_rope_paired"], "paired heads turned by the wrong head's angle"),
    Mutation("kernels.py", "    aligned = all(w.data_ptr() % 16 == 0 for w in weights)", "    aligned = True",
             ["tests/test_kernels.py", "-k", "aligned_only_when"], "a weight group loaded as aligned off 16 bytes"),
    Mutation("bench/step_model.py", '            found["atomic other"] = one_kernel(config, "fa2")',
             '            found["atomic other"] = one_kernel(configs[4], "fa2")',
             ["tests/test_step_model.py", "-k", "both_window_classes"],
             "the other window class's backward priced on the window's tiles"),
    Mutation("kernels.py", "    return tuple(dict.fromkeys((mine, other)))", "    return (mine,)",
             ["tests/test_kernel_choice.py", "-k", "attention_selection"],
             "the selection times attention at the window's tiles only"),
    Mutation("kernels.py", "        _quantize_tile(dx1.to(dtype).to(tl.float32), rows.to(tl.int64), first + cols,",
             "        _quantize_tile(dx1, rows.to(tl.int64), first + cols,",
             ["tests/test_kernels.py", "-k", "fp8_qkv_norm_rope"],
             "the fused QKV gradient cast without the bf16 rounding the unfused chain stores"),
    Mutation("kernels.py", "        first = (part * num_heads + head) * 2 * HALF",
             "        first = head * 2 * HALF",
             ["tests/test_kernels.py", "-k", "fp8_qkv_norm_rope"], "the fused QKV gradient writes k's columns over q's"),
    Mutation("train_gpt.py", "                                    *rotary.angles(0, positions), rotary.stationary, key_starts,",
             "                                    *rotary.angles(0, positions), rotary.stationary, None,",
             ["tests/test_model.py", "-k", "one_op_with_the_composition"],
             "the fused QKV projection loses the key offset"),
    Mutation("train_gpt.py", "        v = self.values(v, x, ve, gates).to(q.dtype)", "        v = v.to(q.dtype)",
             ["tests/test_model.py", "-k", "one_op_with_the_composition"],
             "the fused QKV projection's values skip the value embeddings and gates"),
    Mutation("kernels.py", "    return grad_effective * gain.detach().to(grad_effective.dtype), grad_gain",
             "    return grad_effective, grad_gain",
             ["tests/test_kernels.py", "-k", "gain_on_the_weight"], "an FP8 layer's weight gradient misses its gain"),
    Mutation("kernels.py", "    return w_scale if gain is None else w_scale * gain.detach().float().reshape(1)",
             "    return w_scale",
             ["tests/test_kernels.py", "-k", "gain_on_the_weight"], "an FP8 layer's GEMMs ignore the weight's gain"),
    Mutation("train_gpt.py", "        return self.resid_scales[1] * x + self.mlps(rms_norm(x), args, gain=self.post_scales[1])",
             "        return self.resid_scales[1] * x + self.mlps(rms_norm(x), args)",
             ["tests/test_model_statement.py"], "the dense trunk's MLP output scale dropped"),
]


def repository_files():
    """Tracked files and untracked ones git does not ignore, relative to the repository."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                         capture_output=True, check=True, timeout=60).stdout
    return [p for p in out.decode().split("\0") if p and os.path.isfile(os.path.join(REPO, p))]


def copy_repository(dest):
    for rel in repository_files():
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        shutil.copy2(os.path.join(REPO, rel), os.path.join(dest, rel))


def selection_passes(copy, tests):
    """Run a selection on the unmutated copy; SystemExit when it fails there (then every mutation
    it judges would count as killed)."""
    killed, last = run_selection(copy, tests)
    if killed:
        raise SystemExit(f"mutation_check: the selection {' '.join(tests)} fails without a mutation ({last}): fix the "
                         f"tests or the code first")


def run_selection(copy, tests):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    try:
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], cwd=copy,
                             env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return True, f"timed out after {TIMEOUT_S} s"
    last = (res.stdout.strip().splitlines() or [""])[-1]
    if res.returncode == 0:
        return False, last
    if res.returncode != 1:        # 2-5: interrupted, internal error, usage, nothing collected
        raise SystemExit(f"mutation_check: the selection {' '.join(tests)} did not run (exit {res.returncode}): "
                         f"{last}")
    return True, last


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("only", nargs="*", type=int, help="numbers of the mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--group", choices=GROUPS, help="only the mutations of this group")
    args = parser.parse_args()
    chosen = [(i, m) for i, m in enumerate(MUTATIONS, 1)
              if (not args.only or i in args.only) and (not args.group or m.group == args.group)]
    if args.list:
        for i, m in chosen:
            print(f"{i:3d}  {m.group:9s} {m.path:24s} {m.what}")
        return 0
    survivors = []
    with tempfile.TemporaryDirectory(prefix="mutation_check_") as copy:
        copy_repository(copy)
        for tests in dict.fromkeys(tuple(m.tests) for _, m in chosen):
            selection_passes(copy, list(tests))
        for i, m in chosen:
            path = os.path.join(copy, m.path)
            with open(path) as f:
                original = f.read()
            if original.count(m.old) != 1:
                raise SystemExit(f"mutation_check: mutation {i} ({m.what}): its line occurs {original.count(m.old)} "
                                 f"times in {m.path}, not once: update the mutation")
            with open(path, "w") as f:
                f.write(original.replace(m.old, m.new))
            start = time.perf_counter()
            try:
                killed, last = run_selection(copy, m.tests)
            finally:
                with open(path, "w") as f:
                    f.write(original)
            print(f"{i:3d} {'killed ' if killed else 'SURVIVED'} {time.perf_counter() - start:5.0f} s  "
                  f"{m.path}: {m.what}  [{last}]", flush=True)
            if not killed:
                survivors.append((i, m))
    for group in GROUPS:
        total = sum(m.group == group for _, m in chosen)
        if total:
            left = sum(m.group == group for _, m in survivors)
            print(f"{group}: killed {total - left} of {total} mutations ({100 * (total - left) / total:.0f}%)")
    print(f"\nkilled {len(chosen) - len(survivors)} of {len(chosen)} mutations "
          f"({100 * (len(chosen) - len(survivors)) / len(chosen):.0f}%)")
    for i, m in survivors:
        print(f"survived: {i} {m.path}: {m.what}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
