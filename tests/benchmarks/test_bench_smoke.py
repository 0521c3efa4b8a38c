"""Smoke tests of the benchmark helpers on tiny in-code models (no kvpress, no SmolLM2, fast)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import roofline
from benchmarks.full_cache_scaling import configs, measure_length
from benchmarks.kvpress import common as kvpress_common
from benchmarks.kvpress import faithfulness as kvpress_faithfulness
from benchmarks.kvpress import ours as kvpress_ours
from benchmarks.kvpress import vs_kvpress
from benchmarks.run_all import FULL, QUICK, has_flag, module_exists, module_of
from pipeline.kv.attention.registered import register
from tests.tiny import tiny_loaded, tiny_model


@pytest.fixture(scope="module")
def tiny():
    loaded = tiny_loaded("llama", layers=2)
    loaded.model.set_attn_implementation(register())
    return loaded


def test_limits_are_positive():
    limits = roofline.measure_limits(bandwidth_mib=4, matmul_n=64, repeats=1)
    assert limits.copy_gbs > 0 and limits.read_gbs > 0 and limits.matmul_gflops > 0
    assert limits.bandwidth_gbs == max(limits.copy_gbs, limits.read_gbs)
    assert len(limits.rows()) == 3
    better = roofline.Limits(limits.copy_gbs * 2, 0.0, 0.0, 4, 64)
    best = limits.best(better)
    assert best.copy_gbs == better.copy_gbs and best.read_gbs == limits.read_gbs and limits.best(None) is limits


def test_bounds_on_tiny_model():
    model = tiny_model("mistral", layers=2)  # GQA: 6 query heads, 2 KV heads
    shape = roofline.model_shape(model)
    assert (shape.layers, shape.q_heads, shape.kv_heads, shape.groups) == (2, 6, 2, 3)
    assert shape.weight_bytes == sum(p.numel() * 4 for p in model.parameters())
    limits = roofline.Limits(copy_gbs=10.0, read_gbs=20.0, matmul_gflops=100.0, bandwidth_mib=1, matmul_n=1)
    small, bytes_small, _ = roofline.decode_bound_s(shape, 100, limits)
    large, bytes_large, _ = roofline.decode_bound_s(shape, 10_000, limits)
    assert 0 < small < large and bytes_large - bytes_small == 9_900 * shape.kv_entry_bytes_fp32
    assert roofline.full_norm_flops(shape, 64) == roofline.exact_norm_flops(shape, 64 * shape.kv_heads * shape.layers)
    assert roofline.prefill_flops(shape, 128) > 2 * roofline.prefill_flops(shape, 64) * 0.99


def test_report_helpers():
    text = roofline.table(["a", "b"], [["x", 1]])
    assert text.splitlines()[1] == "|---|---:|"
    head = roofline.header("title")
    assert head.startswith("# title") and "- machine:" in head and "- command:" in head
    assert roofline.fmt_ratio(1.0, 2.0) == "0.50" and roofline.fmt_ratio(1.0, 0.0) == "n/a"
    assert roofline.parse_ints("1,2,") == [1, 2]
    with roofline.PeakRSS() as mem:
        torch.ones(1000)
    assert mem.delta_bytes is None or mem.delta_bytes >= 0


def test_agreement_and_score_gap():
    ours = [[[0, 1, 2], [3, 4, 5]]]
    theirs = [[[0, 1, 2], [3, 4, 6]]]
    ag = kvpress_faithfulness.agreement(ours, theirs)
    assert ag["heads"] == 2 and ag["identical"] == 1 and ag["differing_entries"] == 2
    assert ag["min_jaccard"] == pytest.approx(2 / 4)
    scores = [torch.tensor([[9.0, 8, 7, 0, 0, 0, 0], [0, 0, 0, 5.0, 4.0, 1.0, 1.0 + 1e-6]])]
    gap, stage1 = kvpress_faithfulness.score_gap_at_differences(ours, theirs, scores)
    assert gap < 1e-5 and stage1 == 0
    assert kvpress_faithfulness.kvpress_n_kept(1024, 0.2) == 204  # int(1024 * (1 - (1 - 0.2))) in floats


def test_venv_commands_install_torch_first(tmp_path):
    cmds = kvpress_common.venv_commands(tmp_path / "v", "python3", tmp_path / "c.txt")
    assert cmds[0][1:3] == ["-m", "venv"]
    assert cmds[1][-1] == f"torch=={kvpress_common.TORCH_VERSION}"
    assert (
        "-c" in cmds[2] and "kvpress==0.5.5" in cmds[2] and "transformers==5.2.0" in cmds[2] and "pandas<3" in cmds[2]
    )
    assert kvpress_common.venv_stamp(tmp_path / "v").name.startswith(".ckv-kvpress-")


def test_our_kept_positions_on_tiny_model(tiny):
    n, budget = 160, 70
    ids = torch.randint(0, 250, (1, n))
    kept = kvpress_faithfulness.our_kept(
        tiny.model, ids, ["snapkv", "criticalkv-snapkv", "criticalkv-adakv-snapkv"], budget
    )
    heads = tiny.model.config.num_key_value_heads
    for method in ("snapkv", "criticalkv-snapkv"):
        layers = kept[method]["kept"]
        assert len(layers) == 2 and all(len(layer) == heads for layer in layers)
        assert all(len(h) == budget and h[-64:] == list(range(n - 64, n)) for layer in layers for h in layer)
        assert kept[method]["base_scores"][0].shape == (heads, n)
    assert all(sum(len(h) for h in layer) == heads * budget for layer in kept["criticalkv-adakv-snapkv"]["kept"])


def test_kvpress_adakv_rule_on_tiny_model(tiny):
    n, budget = 160, 70
    capture = kvpress_faithfulness.capture_prefill(tiny.model, torch.randint(0, 250, (1, n)), budget=budget)
    kept, hb, n_safe = kvpress_faithfulness.kvpress_adakv_rule(capture, 0, 0, budget)
    assert len(kept) == hb and n_safe == int(budget * 0.2)
    assert set(range(n - 64, n)) <= kept or hb < 64


def test_engine_document_run_on_tiny_model(tiny):
    engine = kvpress_ours.make_engine(tiny, "criticalkv-adakv-snapkv", 0.5, new_tokens=3, batch_size=2)
    docs = [roofline.document_of_tokens(tiny.tokenizer, 200, seed=s) for s in (0, 1)]
    res = kvpress_ours.our_docs_run(engine, docs, new_tokens=3)
    assert res["total_s"] > 0 and res["decode_ms"] is not None
    assert 0 < res["kv_entries"] < res["kv_entries_full"] and len(res["kv_bytes_each"]) == 2
    ctx, q = kvpress_ours.encode_for_kvpress(engine, docs[0], 3)
    assert len(ctx) == res["context_tokens"][0] and len(q) == res["question_tokens"]


def test_scaling_measure_on_tiny_model(tiny):
    ids = torch.randint(0, 250, (1, 128))
    res = measure_length(tiny.model, ids, configs(0.25), repeats=1, prefill_repeats=1, decode_steps=2)
    assert res["none"]["kv_entries"] == 128 * 2 * tiny.model.config.num_key_value_heads
    assert res["criticalkv-adakv-snapkv"]["kv_bytes"] < res["none"]["kv_bytes"]
    assert all(len(r["decode_ms"]) == 1 for r in res.values())


def test_vs_kvpress_arguments_and_defaults():
    args = vs_kvpress.parse_args(["--sections", "2,3", "--lengths", "512"])
    assert (args.sections, args.lengths, args.repeats, args.cache_size) == ("2,3", "512", 3, 0.2)
    assert args.methods.split(",") == ["none", "snapkv", "criticalkv-snapkv", "criticalkv-adakv-snapkv"]


def test_run_all_flag_filter():
    assert has_flag("  --lengths LENGTHS", "--lengths")
    assert not has_flag("  --faith-lengths X", "--lengths")


def test_method_costs_measure_on_tiny_model():
    from benchmarks import method_costs
    from pipeline.engine.config import GenerationConfig
    from pipeline.engine.engine import Engine
    from pipeline.kv.config import CompressionConfig

    loaded = tiny_loaded("llama", layers=2)

    def engine_for(method):
        config = CompressionConfig(method=method, cache_size=1.0 if method == "none" else 0.3, window=4, kernel=3)
        return Engine(loaded, config, GenerationConfig(max_new_tokens=1))

    res = method_costs.measure(engine_for, loaded.tokenizer, ["none", "layer-kvzip", "snapkv"], 120, repeats=1)
    assert res["none"]["kept"] > 1.0 > 0.4 > res["layer-kvzip"]["kept"] > 0.25
    assert all(len(r["seconds"]) == 1 and r["seconds"][0] > 0 for r in res.values())
    # the prefill is one forward of the context; KVzip adds its passes (one chunk here), each a
    # repeat prompt plus the chunk's own tokens
    n = res["none"]["tokens"]
    assert res["none"]["forwards"] == res["snapkv"]["forwards"] == [n]
    first, *passes = res["layer-kvzip"]["forwards"]
    assert first == n and len(passes) == 1 and passes[0] > n - 20
    cfg = loaded.model.config
    weights = sum(p.numel() for layer in loaded.model.base_model.layers for p in layer.parameters() if p.dim() == 2)
    per_key = 4 * cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads) * cfg.num_hidden_layers
    naive_plain = sum(2 * weights + per_key * (i + 1) for i in range(n))  # token i sees keys 0..i
    naive_pass = sum(2 * weights + per_key * (n + j + 1) for j in range(passes[0]))
    assert method_costs.forward_flops(loaded.model, [n]) == pytest.approx(naive_plain)
    assert method_costs.forward_flops(loaded.model, [n, *passes]) == pytest.approx(naive_plain + naive_pass)


def test_ragged_decode_interleaves_both_kernels_on_one_cache(tiny, monkeypatch):
    from benchmarks import ragged_decode
    from pipeline.kv.attention.varlen_kernels import RAGGED_ENV

    monkeypatch.setenv(RAGGED_ENV, "")
    ids = torch.randint(3, 200, (1, 128), generator=torch.Generator().manual_seed(0))  # long enough to be ragged
    res = ragged_decode.interleaved(tiny.model, ids, cache_size=0.5, steps=4)
    assert {name: len(ms) for name, ms in res["times"].items()} == {"flat": 2, "blocked": 2, "uniform": 2}
    assert res["kernels"] == ["blocked", "flat"] and res["slots"] > 0


@pytest.mark.parametrize("side", ["ours", "transformers"])
def test_prefill_memory_samples_a_peak_inside_the_model(side):
    from benchmarks import prefill_memory
    from pipeline.engine.config import GenerationConfig, ModelConfig
    from pipeline.kv.config import CompressionConfig
    from tests.distributed.helpers import tiny_engine

    engine = tiny_engine(ModelConfig(name="tiny-llama"), CompressionConfig(method="none"), GenerationConfig())
    result = prefill_memory.measure(engine, side, n_tokens=256, new_tokens=3)
    assert result["side"] == side and result["tokens"] == 256 and result["peak"] >= 0
    assert result["where"] == "start" or result["where"].startswith(("layer ", "lm_head"))


def test_memory_plot_draws_one_line_per_side(tmp_path):
    from benchmarks import prefill_memory

    curves = {"none": [(2048, 150.0), (4096, 260.0)], "kvzap[prefill_chunk=1024]": [(2048, 60.0), (4096, 70.0)]}
    prefill_memory.plot_curves({"transformers": curves["none"], **curves}, 0.2, str(tmp_path / "b.png"))
    assert (tmp_path / "b.png").stat().st_size > 1000


def test_throughput_plot_draws_every_side(tmp_path):
    from benchmarks import throughput

    results = {
        "transformers DynamicCache, batch 2": {"wall": 10.0, "tokens": 80, "mean_batch": None, "largest_batch": 2},
        "ours none, continuous": {"wall": 9.0, "tokens": 80, "mean_batch": 2.0, "largest_batch": 2},
        "ours criticalkv-shares-kvzap @ 0.2, continuous": {
            "wall": 6.0,
            "tokens": 80,
            "mean_batch": 7.5,
            "largest_batch": 8,
        },
    }
    args = type("Args", (), {"docs": 8, "length": 4096, "new_tokens": 256})()
    path = tmp_path / "plot" / "throughput.png"
    throughput.plot(results, args, 200 * 2**20, str(path))
    assert path.stat().st_size > 5000


def test_throughput_checks_the_peak_against_the_budget_plus_one_prefill():
    from benchmarks import throughput

    mib = 2**20
    assert throughput.memory_cells({"peak": 150 * mib, "prefill_peak": 60 * mib}, 100 * mib) == ["150", "60", "yes"]
    assert throughput.memory_cells({"peak": 170 * mib, "prefill_peak": 60 * mib}, 100 * mib) == ["170", "60", "**no**"]
    assert throughput.memory_cells({"peak": 90 * mib, "prefill_peak": None}, 100 * mib) == ["90", "-", "-"]


def test_run_all_names_a_module_for_every_benchmark():
    """make bench runs each benchmark as a module; a name that resolves to nothing would be skipped."""
    for name in {*FULL, *QUICK}:
        assert module_exists(name), f"{name} -> {module_of(name)} is not a module file"
    assert module_of("vs_kvpress") == "benchmarks.kvpress.vs_kvpress"
    assert not module_exists("kvpress_side")


def test_sweep_profile_finds_every_phase_on_a_tiny_engine():
    from benchmarks import sweep_profile
    from pipeline.engine.config import GenerationConfig
    from pipeline.engine.engine import Engine
    from pipeline.engine.types import Request
    from pipeline.kv.config import CompressionConfig

    settings = [CompressionConfig(method="none")]
    settings += [CompressionConfig(method=m, cache_size=0.5, window=4) for m in ("snapkv", "kvzip")]
    engine = Engine(tiny_loaded(), settings[0], GenerationConfig(max_new_tokens=4))
    text = "The quick brown fox jumps over the lazy dog. " * 6
    result = sweep_profile.profile_sweep(engine, [Request("a", text, ["Who jumps?"])], settings)
    assert result["rows"] == 3
    phases = result["phases"]
    assert set(phases) == set(sweep_profile.PHASES) and all(s > 0 for s in phases.values()), phases
    assert sum(phases.values()) < result["wall_s"]  # phases do not nest in each other
    table = sweep_profile.markdown(result, 1, 3)
    assert "| KVzip passes |" in table and "| everything else |" in table


def test_decode_precision_compares_both_dense_kernels_on_a_tiny_model():
    import copy

    from benchmarks import decode_precision
    from pipeline.kv.config import CompressionConfig

    model = tiny_model("llama", layers=2)
    model.set_attn_implementation(register())
    models = {"float32": model, "bfloat16": copy.deepcopy(model).to(torch.bfloat16)}
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    result = decode_precision.compare_document(
        models, ids, CompressionConfig(method="snapkv", cache_size=0.5, window=4), 3
    )
    assert set(result["kernels"]) == set(decode_precision.KERNELS)
    assert result["kernels"]["grouped"]["kernels"] == ["dense-grouped"]
    assert result["kernels"]["sdpa"]["kernels"] == ["dense-sdpa"]
    for r in result["kernels"].values():
        assert 0.0 <= r["top1"] <= 1.0 and 0.0 < r["max_abs"] < result["ref_scale"]
    assert 0.0 < result["between"] < result["ref_scale"]  # bf16 kernels differ, by less than the logits' size


def test_sizing_uses_the_stores_bytes_per_kept_token():
    import torch

    from benchmarks.sizing import kv_bytes_per_token, rows
    from pipeline.kv.storage.store import VarLenLayer

    heads, n, dim = 3, 10, 16
    key = torch.randn(1, heads, n, dim, dtype=torch.bfloat16)
    keep = torch.zeros(1, heads, n, dtype=torch.bool)
    keep[..., :4] = True  # 4 of 10 tokens kept in every head
    layer = VarLenLayer.from_dense(key, key.clone(), torch.arange(n)[None], keep)
    segment_tables = heads * 3 * 8  # start, length, capacity: int64 per (row, head)
    assert int(layer.bytes_per_row()[0]) == 4 * kv_bytes_per_token(1, heads, dim) + segment_tables
    table = rows([24.0, 80.0])
    assert len(table) == 2 + 2 * 4 and "| Llama-3.1-8B | 24 GiB | 15.0 | 129.0 |" in table[2]


def test_kept_composition_classes_and_masks_on_a_tiny_engine():
    """Each context token gets one class (template head, window, the needle holding the answer, other
    needles, the instruction, haystack), and the kept masks are the cache's kept positions."""
    from benchmarks import kept_composition as kc
    from pipeline.engine.config import GenerationConfig
    from pipeline.engine.engine import Engine
    from pipeline.kv.config import CompressionConfig

    loaded = tiny_loaded("llama", layers=2)
    engine = Engine(loaded, CompressionConfig(method="snapkv", cache_size=0.3, window=4), GenerationConfig())
    filler = "the grass is green and the sky is blue . " * 4
    context = (
        "Remember the numbers.\n"
        + filler
        + "One of the special magic numbers for cat is: 123. "
        + filler
        + "One of the special magic numbers for dog is: 456. "
        + filler
    )
    doc = {"doc_id": "d", "context": context, "questions": ["cat?"], "answer_prefix": "", "references": [["123"]]}
    mask, prefix = kc.kept_masks(engine, doc)
    prompt = engine.prompts.encode(context, ["cat?"])
    assert prefix == prompt.prefix_tokens and mask.shape == (2, engine.shape.num_kv_heads, len(prompt.context_ids))
    cache = engine.compress_context(kc.Request("d", context, ["cat?"]))
    assert mask.sum().item() == sum(len(cache.kept_positions(i, 0, h)) for i in range(2) for h in range(mask.shape[1]))
    classes = kc.token_classes(engine.tokenizer, doc, prefix, mask.shape[-1], window=4)
    names = [kc.CLASSES[c] for c in classes.tolist()]
    assert names[:prefix] == ["template"] * prefix and names[-4:] == ["window"] * 4
    tokens = prompt.context_ids
    needle = [engine.tokenizer.decode([tokens[i]]) for i, n in enumerate(names) if n == "needle"]
    other = [engine.tokenizer.decode([tokens[i]]) for i, n in enumerate(names) if n == "distractor"]
    assert "123" in "".join(needle).replace(" ", "") and "456" in "".join(other).replace(" ", "")
    assert "instruction" in names and names.count("haystack") > len(names) // 2
    fractions = kc.composition(mask, classes)
    assert fractions["window"] == 1.0 and all(0.0 <= f <= 1.0 for f in fractions.values())


def test_commit_times_hands_on_every_document_at_each_pause():
    from benchmarks import commit_times
    from pipeline.engine.config import GenerationConfig
    from pipeline.engine.engine import Engine
    from pipeline.engine.types import Request
    from pipeline.kv.config import CompressionConfig

    engine = Engine(tiny_loaded(), CompressionConfig(method="snapkv", window=4), GenerationConfig(max_new_tokens=4))
    text = "The quick brown fox jumps over the lazy dog. " * 6
    requests = [Request(str(i), text, ["Who jumps?"]) for i in range(3)]
    for pause in (0.0, 100.0):
        handed, wall = commit_times.one_call(engine, requests, pause)
        assert len(handed) == 3 and handed == sorted(handed) and 0 < handed[-1] <= wall
        assert engine.runner.generation.decode_between_prefills == pause
    assert len(commit_times.documents("mixed")) == len(commit_times.documents("qa")) == 8
    with pytest.raises(SystemExit):  # the command line parses up to --help (main's defaults resolve)
        commit_times.main(["--help"])
