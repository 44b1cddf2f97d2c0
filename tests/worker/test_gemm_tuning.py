"""Start-up matmul tuning (kvserve/kernels/cublaslt.py): the choice rule, the saved results, which row counts
are tuned, and that nothing changes where cuBLASLt cannot run (CPU). The cuBLASLt calls themselves are
tested on the GPU (tests/gpu/test_gpu_ops.py, test_gpu_engine.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine_core import EngineCore
from kvserve.kernels import cublaslt, ops
from kvserve.layers.linear import Linear
from kvserve.worker import model_runner
from kvserve.worker.model_runner import ModelRunner


def test_pick_takes_the_fastest_and_prefers_torch_on_ties() -> None:
    assert cublaslt.pick({cublaslt.TORCH_CHOICE: 10.0, 0: 11.0, 1: 9.5, 2: 9.9}) == 1
    assert cublaslt.pick({cublaslt.TORCH_CHOICE: 9.5, 0: 9.5, 1: 9.5}) == cublaslt.TORCH_CHOICE
    assert cublaslt.pick({0: 9.5, 3: 9.5}) == 0  # equal candidates: the heuristic's earlier rank
    # A failed timing never wins; with nothing timed, torch runs.
    assert cublaslt.pick({cublaslt.TORCH_CHOICE: 10.0, 0: math.nan, 1: math.inf}) == cublaslt.TORCH_CHOICE
    assert cublaslt.pick({}) == cublaslt.TORCH_CHOICE


def test_the_loaded_cublaslt_is_found_in_the_process_map() -> None:
    maps = (
        "7f00-7f10 r-xp 00000000 00:00 1 /usr/lib/libc.so.6\n"
        "7f20-7f30 r--p 00000000 00:00 2\n"
        "7f40-7f50 r-xp 00000000 00:00 3 /venv/nvidia/cu13/lib/libcublasLt.so.13\n"
        "7f60-7f70 r-xp 00000000 00:00 4 /venv/nvidia/cu13/lib/libcublas.so.13\n"
    )
    assert cublaslt._mapped_library(maps, "libcublasLt") == "/venv/nvidia/cu13/lib/libcublasLt.so.13"
    assert cublaslt._mapped_library(maps, "libcublas") == "/venv/nvidia/cu13/lib/libcublas.so.13"
    assert cublaslt._mapped_library(maps, "libcudnn") is None


def test_saved_results_round_trip_and_a_bad_file_reads_as_empty(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "gemm_tuning.json"
    assert cublaslt.load_cache(path) == {}
    results = {"H200|cublasLt 130100|torch 2.11|bfloat16|64x4608x3584|bias 1":
               {"choice": 3, "algo": [2**64 - 1, 0, 5, 6, 7, 8, 9, 10], "torch_us": 11.9, "chosen_us": 11.5}}
    cublaslt.save_cache(path, results)
    assert cublaslt.load_cache(path) == results
    assert not list(path.parent.glob("*.tmp"))  # written through a temporary file, renamed into place
    path.write_text("{not json")
    assert cublaslt.load_cache(path) == {}
    path.write_text("[1, 2]")
    assert cublaslt.load_cache(path) == {}


def test_cublaslt_is_unavailable_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine has cuBLASLt")
    with pytest.raises(cublaslt.LtUnavailable):
        cublaslt.LtMatmul(64, 128, 256, torch.bfloat16, False, 0)


def _runner_stub(use_cuda_graphs: bool, graph_sizes: list[int]) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(use_cuda_graphs=use_cuda_graphs, cuda_graph_sizes=graph_sizes))


def test_tuned_rows_are_the_decode_graph_sizes_past_the_skinny_matmul() -> None:
    sizes = [1, 2, 4, 8, 16, 32, 48, 64, 256]
    stub = _runner_stub(True, sizes)
    rows = ModelRunner.gemm_tuning_rows(stub)  # type: ignore[arg-type]
    assert rows == [48, 64, 256]
    assert all(n > ops.SKINNY_GEMM_MAX_ROWS for n in rows)
    # Eager: batches come in every size, nothing is tuned.
    eager = _runner_stub(False, sizes)
    assert ModelRunner.gemm_tuning_rows(eager) == []  # type: ignore[arg-type]


def test_cpu_engine_tunes_nothing_even_when_asked(tiny_model_dir: Callable[..., str], tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve import envs

    monkeypatch.setattr(envs, "KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(envs, "KVSERVE_GEMM_TUNING", True)  # asked for, but there is no cuBLASLt on the CPU
    args = EngineArgs(model=tiny_model_dir("llama"), device="cpu", max_model_len=256, kv_cache_memory="8MiB")
    core = EngineCore(args.create_engine_config())
    assert not core.runner.gemm_tuning_enabled()
    assert core.runner.tune_gemms() == []
    assert cublaslt.num_tuned() == 0
    assert not list(tmp_path.iterdir())  # no results file written


# ------------------------------------------------------------------ tune() with a fake cuBLASLt (CPU)


class _FakePlan:
    """Stands in for LtMatmul: candidate i computes linear plus OFFSETS[i] (0: correct), and records the
    candidate each run used, so the fake timer knows what it times."""

    OFFSETS: list[float] = [0.0, 0.0, 0.0]
    made: list[_FakePlan] = []

    def __init__(self, rows: int, n: int, k: int, dtype: torch.dtype, has_bias: bool, device_index: int) -> None:
        self.rows, self.n, self.k, self.dtype, self.has_bias, self.device_index = rows, n, k, dtype, has_bias, device_index
        self.candidates = []
        for i in range(len(self.OFFSETS)):
            algo = cublaslt._Algo()
            algo.data[0] = 1000 + i
            self.candidates.append(algo)
        self.workspace_sizes = [0] * len(self.OFFSETS)
        self.chosen = 0
        self.last: int | None = None
        _FakePlan.made.append(self)

    def check_inputs(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        return tuple(x.shape) == (self.rows, self.k) and (bias is not None) == self.has_bias

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            candidate: int | None = None) -> torch.Tensor:
        index = self.chosen if candidate is None else candidate
        self.last = index
        out.copy_(torch.nn.functional.linear(x, weight, bias) + self.OFFSETS[index])
        return out


@pytest.fixture
def fake_lt(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """tune() on the CPU: a fake plan, a fake timer answering from `times` ({candidate or TORCH_CHOICE: µs}),
    and the list of what was timed."""
    state: dict[str, object] = {"times": {}, "timed": []}
    _FakePlan.OFFSETS = [0.0, 0.0, 0.0]
    _FakePlan.made = []

    def fake_timer(fn: Callable[[], None], *args: object, **kwargs: object) -> float:
        plan = _FakePlan.made[-1]
        plan.last = None
        fn()
        what = cublaslt.TORCH_CHOICE if plan.last is None else plan.last
        state["timed"].append(what)  # type: ignore[union-attr]
        return state["times"][what]  # type: ignore[index]

    def fake_sustained(fns: dict[int, Callable[[], None]], *args: object, **kwargs: object) -> dict[int, float]:
        state["sustained_calls"].append(sorted(fns))  # type: ignore[union-attr]
        return {i: fake_timer(fn) for i, fn in fns.items()}

    state["sustained_calls"] = []
    monkeypatch.setattr(cublaslt, "LtMatmul", _FakePlan)
    monkeypatch.setattr(cublaslt, "_time_graph_us", fake_timer)
    monkeypatch.setattr(cublaslt, "_time_sustained_us", fake_sustained)
    monkeypatch.setattr(cublaslt, "_device_name", lambda device: "fake GPU")
    monkeypatch.setattr(cublaslt, "library_version", lambda: 1)
    cublaslt.clear_tuning()
    yield state
    cublaslt.clear_tuning()


def _weights(n: int = 6, k: int = 8, bias: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(n * k)
    weights = [torch.randn(n, k, generator=gen) for _ in range(2)]
    return weights, [torch.randn(n, generator=gen) if bias else None for _ in range(2)]


def test_tune_registers_the_fastest_correct_candidate(fake_lt: dict) -> None:
    _FakePlan.OFFSETS = [0.0, 5.0, 0.0]  # candidate 1 computes the wrong thing
    fake_lt["times"].update({cublaslt.TORCH_CHOICE: 100.0, 0: 99.5, 1: 50.0, 2: 90.0})
    weights, biases = _weights()
    cache: dict[str, dict] = {}
    result = cublaslt.tune(4, weights, biases, cache=cache)
    assert result.choice == 2 and result.num_wrong == 1 and not result.cached
    assert sorted(fake_lt["timed"]) == [cublaslt.TORCH_CHOICE, 0, 2]  # the wrong one is never timed
    assert result.torch_us == 50.0 and result.chosen_us == 45.0  # per call: two weights per run
    x = torch.randn(4, 8)
    plan = cublaslt.tuned_plan(x, weights[1], biases[1])
    assert plan is not None and plan.chosen == 2
    assert cublaslt.tuned_plan(torch.randn(5, 8), weights[1], biases[1]) is None  # other rows
    assert cublaslt.tuned_plan(x, weights[1], None) is None  # the shape without bias
    (entry,) = cache.values()
    assert entry["choice"] == 2 and entry["algo"] == [1002, 0, 0, 0, 0, 0, 0, 0]


def test_a_candidate_must_beat_torch_by_the_margin(fake_lt: dict) -> None:
    fake_lt["times"].update({cublaslt.TORCH_CHOICE: 100.0, 0: 99.5, 1: 99.2, 2: 101.0})  # within 1 %
    result = cublaslt.tune(4, *_weights())
    assert result.choice == cublaslt.TORCH_CHOICE and cublaslt.num_tuned() == 0


def test_a_decided_shape_keeps_its_choice_in_the_process(fake_lt: dict) -> None:
    fake_lt["times"].update({cublaslt.TORCH_CHOICE: 100.0, 0: 80.0, 1: 90.0, 2: 95.0})
    weights, biases = _weights()
    first = cublaslt.tune(4, weights, biases)
    fake_lt["timed"].clear()
    fake_lt["times"].update({0: 99.0, 1: 10.0})  # new timings would now choose another candidate
    assert cublaslt.tune(4, weights, biases) is first and not fake_lt["timed"]
    # torch's pick left out is another decision for the same shape.
    forced = cublaslt.tune(4, weights, biases, torch_candidate=False)
    assert forced.choice == 1 and cublaslt.TORCH_CHOICE not in fake_lt["timed"][1:]
    cublaslt.forget({cublaslt.key_of(0, 4, 6, 8, torch.float32, True)})
    assert cublaslt.num_tuned() == 0 and not cublaslt.decided_keys()


def test_forget_drops_only_the_given_shapes(fake_lt: dict) -> None:
    fake_lt["times"].update({cublaslt.TORCH_CHOICE: 100.0, 0: 80.0, 1: 90.0, 2: 95.0})
    cublaslt.tune(4, *_weights())
    cublaslt.tune(8, *_weights())
    assert cublaslt.num_tuned() == 2
    cublaslt.forget({cublaslt.key_of(0, 4, 6, 8, torch.float32, True)})
    assert cublaslt.decided_keys() == {cublaslt.key_of(0, 8, 6, 8, torch.float32, True)}
    assert cublaslt.tuned_plan(torch.randn(8, 8), *[t[0] for t in _weights()]) is not None


def test_stored_choices_are_taken_without_timing_when_still_offered_and_correct(fake_lt: dict) -> None:
    fake_lt["times"].update({cublaslt.TORCH_CHOICE: 100.0, 0: 80.0, 1: 70.0, 2: 95.0})
    weights, biases = _weights()
    cache: dict[str, dict] = {}
    timed = cublaslt.tune(4, weights, biases, cache=cache)
    assert timed.choice == 1
    cublaslt.clear_tuning()
    fake_lt["timed"].clear()
    again = cublaslt.tune(4, weights, biases, cache=cache)
    assert again.cached and again.choice == 1 and not fake_lt["timed"]
    # The stored algorithm computes wrongly now: timed again.
    cublaslt.clear_tuning()
    _FakePlan.OFFSETS = [0.0, 5.0, 0.0]
    retimed = cublaslt.tune(4, weights, biases, cache=cache)
    assert not retimed.cached and retimed.choice == 0 and fake_lt["timed"]
    # A stored algorithm no longer offered, or a malformed entry: timed again.
    for bad in ({"choice": 0, "algo": [999, 0, 0, 0, 0, 0, 0, 0]}, {"choice": "x"}, {"choice": 0, "algo": None}, []):
        cublaslt.clear_tuning()
        fake_lt["timed"].clear()
        cache = {key: bad for key in cache}  # type: ignore[misc]
        assert not cublaslt.tune(4, weights, biases, cache=cache).cached and fake_lt["timed"]


def test_a_stored_torch_choice_is_taken(fake_lt: dict) -> None:
    fake_lt["times"].update({cublaslt.TORCH_CHOICE: 10.0, 0: 80.0, 1: 70.0, 2: 95.0})
    weights, biases = _weights()
    cache: dict[str, dict] = {}
    assert cublaslt.tune(4, weights, biases, cache=cache).choice == cublaslt.TORCH_CHOICE
    cublaslt.clear_tuning()
    fake_lt["timed"].clear()
    made = len(_FakePlan.made)
    result = cublaslt.tune(4, weights, biases, cache=cache)
    assert result.cached and result.choice == cublaslt.TORCH_CHOICE and not fake_lt["timed"]
    assert len(_FakePlan.made) == made  # no plan (no heuristic query) for a stored torch choice


def test_without_torch_every_candidate_wrong_is_an_error(fake_lt: dict) -> None:
    _FakePlan.OFFSETS = [5.0, 5.0, 5.0]
    fake_lt["times"].update({cublaslt.TORCH_CHOICE: 100.0})
    with pytest.raises(cublaslt.LtUnavailable):
        cublaslt.tune(4, *_weights(), torch_candidate=False)
    assert cublaslt.tune(4, *_weights()).choice == cublaslt.TORCH_CHOICE  # with torch competing: torch


def test_sustained_tuning_times_all_choices_together_and_is_stored_apart(fake_lt: dict) -> None:
    """sustained=True hands torch's pick and every correct candidate to the sustained timer in one call; its
    choice is stored under its own key, so a short timing's stored choice for the same shape is not taken
    for it (and the other way round)."""
    _FakePlan.OFFSETS = [0.0, 5.0, 0.0]
    fake_lt["times"].update({cublaslt.TORCH_CHOICE: 100.0, 0: 90.0, 1: 10.0, 2: 95.0})
    weights, biases = _weights()
    cache: dict[str, dict] = {}
    short = cublaslt.tune(4, weights, biases, cache=cache)
    assert short.choice == 0 and not fake_lt["sustained_calls"]
    cublaslt.clear_tuning()
    fake_lt["times"].update({0: 99.5, 2: 80.0})  # under the power cap another candidate wins
    result = cublaslt.tune(4, weights, biases, cache=cache, sustained=True)
    assert fake_lt["sustained_calls"] == [[cublaslt.TORCH_CHOICE, 0, 2]]  # the wrong candidate left out
    assert result.choice == 2 and not result.cached
    assert len(cache) == 2 and sum(key.endswith("|sustained") for key in cache) == 1
    for sustained, choice in ((False, 0), (True, 2)):  # each stored choice found again by its own mode
        cublaslt.clear_tuning()
        fake_lt["timed"].clear()
        again = cublaslt.tune(4, weights, biases, cache=cache, sustained=sustained)
        assert again.cached and again.choice == choice and not fake_lt["timed"]


def test_sustained_timer_warms_each_choice_up_then_times_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """_time_sustained_us: each graph replayed once to upload it, once to size its replay counts; then in each
    pass (starting one choice later each time) replayed for warm_us untimed and timed for at least min_us; a
    choice's time is its mean over the passes."""
    replays: list[tuple[str, int]] = []
    # What each graph's replays answer, in order: upload, sizing, then (warm-up, timing) per pass.
    answers = {"a": [99.0, 10.0, 0.0, 5.0, 0.0, 7.0], "b": [99.0, 20.0, 0.0, 30.0, 0.0, 50.0],
               "c": [99.0, 4.0, 0.0, 8.0, 0.0, 6.0]}

    def fake_replay_us(graph: str, reps: int) -> float:
        replays.append((graph, reps))
        return answers[graph][sum(g == graph for g, _ in replays) - 1]

    monkeypatch.setattr(cublaslt, "_capture", lambda fn: fn())  # the "graph" is the fn's name
    monkeypatch.setattr(cublaslt, "_replay_us", fake_replay_us)
    times = cublaslt._time_sustained_us({-1: lambda: "a", 0: lambda: "b", 1: lambda: "c"}, warm_us=1000.0,
                                        min_us=100.0, rounds=2)
    assert replays[:6] == [("a", 1), ("a", 1), ("b", 1), ("b", 1), ("c", 1), ("c", 1)]
    # Pass 1 in order a, b, c; pass 2 from b; each: warm_us of replays, then at least min_us (3 at the least).
    assert replays[6:] == [("a", 100), ("a", 11), ("b", 50), ("b", 6), ("c", 250), ("c", 26),
                           ("b", 50), ("b", 6), ("c", 250), ("c", 26), ("a", 100), ("a", 11)]
    assert times == {-1: 6.0, 0: 40.0, 1: 7.0}


def test_results_are_compared_in_row_chunks_and_nan_is_wrong(fake_lt: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate's result is checked chunk by chunk (here 2 rows of 4): an offset or a NaN anywhere makes
    it wrong, and only the correct one is timed."""
    monkeypatch.setattr(cublaslt, "_ERROR_CHUNK_ROWS", 2)
    _FakePlan.OFFSETS = [5.0, float("nan"), 0.0]
    fake_lt["times"].update({cublaslt.TORCH_CHOICE: 100.0, 0: 10.0, 1: 10.0, 2: 90.0})
    result = cublaslt.tune(4, *_weights())
    assert result.num_wrong == 2 and result.choice == 2 and sorted(fake_lt["timed"]) == [cublaslt.TORCH_CHOICE, 2]


def test_shipped_choices_are_taken_where_nothing_is_stored(fake_lt: dict, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`defaults` (the shipped sustained choices) answers a shape the stored results do not hold, without
    timing; a stored result for the shape comes first; shipped_choices() reads SHIPPED_CHOICES_PATH."""
    fake_lt["times"].update({cublaslt.TORCH_CHOICE: 100.0, 0: 90.0, 1: 80.0, 2: 95.0})
    weights, biases = _weights()
    key = cublaslt.cache_key(weights[0].device, 4, 6, 8, weights[0].dtype, True, True, True)
    shipped = {key: {"choice": 2, "algo": [1002, 0, 0, 0, 0, 0, 0, 0]}}
    path = tmp_path / "shipped.json"
    cublaslt.save_cache(path, shipped)
    monkeypatch.setattr(cublaslt, "SHIPPED_CHOICES_PATH", path)
    assert cublaslt.shipped_choices() == shipped
    result = cublaslt.tune(4, weights, biases, cache={}, sustained=True, defaults=cublaslt.shipped_choices())
    assert result.cached and result.choice == 2 and not fake_lt["timed"]
    cublaslt.clear_tuning()
    stored = {key: {"choice": cublaslt.TORCH_CHOICE, "algo": None}}
    assert cublaslt.tune(4, weights, biases, cache=stored, sustained=True, defaults=shipped).choice == cublaslt.TORCH_CHOICE
    cublaslt.clear_tuning()
    timed = cublaslt.tune(4, weights, biases, cache={}, sustained=False, defaults=shipped)  # another key: timed
    assert not timed.cached and timed.choice == 1
    monkeypatch.setattr(cublaslt, "SHIPPED_CHOICES_PATH", None)
    assert cublaslt.shipped_choices() == {}


def test_without_timing_a_shape_with_no_usable_choice_runs_torchs_pick(fake_lt: dict) -> None:
    """time_missing=False (KVSERVE_PREFILL_GEMM_TUNING=1): a stored or shipped choice is taken as before, but
    where none is usable (none stored, or its algorithm no longer offered) torch's pick runs, untimed and not
    stored, so that a later start allowed to time still does."""
    fake_lt["times"].update({cublaslt.TORCH_CHOICE: 100.0, 0: 90.0, 1: 80.0, 2: 95.0})
    weights, biases = _weights()
    cache: dict[str, dict] = {}
    result = cublaslt.tune(4, weights, biases, cache=cache, sustained=True, time_missing=False)
    assert result.choice == cublaslt.TORCH_CHOICE and not result.cached and not fake_lt["timed"]
    assert cache == {} and cublaslt.num_tuned() == 0
    key = cublaslt.cache_key(weights[0].device, 4, 6, 8, weights[0].dtype, True, True, True)
    for algo, choice in (([1001, 0, 0, 0, 0, 0, 0, 0], 1), ([999, 0, 0, 0, 0, 0, 0, 0], cublaslt.TORCH_CHOICE)):
        cublaslt.clear_tuning()
        shipped = {key: {"choice": 0, "algo": algo}}
        got = cublaslt.tune(4, weights, biases, cache=cache, sustained=True, defaults=shipped, time_missing=False)
        assert got.choice == choice and not fake_lt["timed"] and cache == {}


@pytest.mark.parametrize("sustained", [False, True])
def test_an_untimed_result_is_not_a_decision(fake_lt: dict, sustained: bool) -> None:
    """A lookup that found nothing (torch's pick, untimed) does not fix the shape's choice for the process: a
    later tune() of the shape that may time it (another engine with KVSERVE_GEMM_TUNING=1, say) does."""
    fake_lt["times"].update({cublaslt.TORCH_CHOICE: 100.0, 0: 90.0, 1: 80.0, 2: 95.0})
    weights, biases = _weights()
    first = cublaslt.tune(4, weights, biases, cache={}, sustained=True, time_missing=False)
    assert first.untimed and cublaslt.decided_keys() == set()
    later = cublaslt.tune(4, weights, biases, cache={}, sustained=sustained)
    assert not later.untimed and later.choice == 1 and fake_lt["timed"]
    assert cublaslt.num_tuned() == 1 and len(cublaslt.decided_keys()) == 1


def test_the_shipped_choices_file_is_well_formed() -> None:
    """Every shipped entry is a sustained result in the stored results' format."""
    shipped = cublaslt.shipped_choices()
    assert shipped and all(key.endswith("|sustained") for key in shipped)
    assert all(cublaslt._valid_entry(entry) for entry in shipped.values())
    # For the stack they were measured on, they cover the default decode graph sizes past the skinny matmul
    # up to 256 (the default max_num_seqs) and the default step budget, for the four layer shapes (n x k) of
    # Qwen2.5-7B (q/k/v, o_proj, gate/up, down).
    from kvserve.config import DEFAULT_CUDA_GRAPH_SIZES

    h200 = "v1|NVIDIA H200|cublasLt 130100|torch 2.11.0+cu130|_BlasBackend.Cublaslt|reduced 1|bfloat16|"
    rows_shapes = {key.removeprefix(h200).split("|")[0] for key in shipped if key.startswith(h200)}
    decode = [n for n in DEFAULT_CUDA_GRAPH_SIZES if ops.SKINNY_GEMM_MAX_ROWS < n <= 256]
    shapes = ["4608x3584", "3584x3584", "37888x3584", "3584x18944"]
    assert {f"{rows}x{shape}" for rows in [*decode, 8192] for shape in shapes} <= rows_shapes


def _tuning_stub(device: str, use_cuda_graphs: bool, graph_sizes: list[int], budget: int) -> SimpleNamespace:
    stub = SimpleNamespace(device=torch.device(device), config=SimpleNamespace(
        use_cuda_graphs=use_cuda_graphs, cuda_graph_sizes=graph_sizes,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=budget)))
    stub.gemm_tuning_rows = lambda: ModelRunner.gemm_tuning_rows(stub)  # type: ignore[arg-type]
    stub.prefill_gemm_tuning_rows = lambda: ModelRunner.prefill_gemm_tuning_rows(stub)  # type: ignore[arg-type]
    return stub


@pytest.mark.parametrize("decode_mode", ["short", "stored", "off"])
@pytest.mark.parametrize("prefill_mode", [1, 2])
def test_the_tuning_plan_adds_the_step_budget_timed_sustained(monkeypatch: pytest.MonkeyPatch, decode_mode: str,
                                                               prefill_mode: int) -> None:
    """The step budget's rows are tuned sustained when they are past the CUDA graphs' prefill sizes (steps
    that run eagerly), timed at start only with KVSERVE_PREFILL_GEMM_TUNING=2; never on the CPU, nor with
    KVSERVE_PREFILL_GEMM_TUNING off. The decode graph sizes are timed briefly with KVSERVE_GEMM_TUNING, else
    take the stored or shipped sustained choices untimed (KVSERVE_DECODE_GEMM_CHOICES, the default); a decode
    graph size equal to the budget is tuned once, as the budget."""
    from kvserve import envs

    monkeypatch.setattr(envs, "KVSERVE_GEMM_TUNING", decode_mode == "short")
    monkeypatch.setattr(envs, "KVSERVE_DECODE_GEMM_CHOICES", decode_mode != "off")  # "short" wins over it
    monkeypatch.setattr(envs, "KVSERVE_PREFILL_GEMM_TUNING", prefill_mode)
    decode = {"short": [(48, False, True), (64, False, True)], "stored": [(48, True, False), (64, True, False)],
              "off": []}[decode_mode]
    budget = (8192, True, prefill_mode == 2)
    plan = ModelRunner.gemm_tuning_plan  # type: ignore[arg-type]
    assert plan(_tuning_stub("cuda", True, [8, 48, 64], 8192)) == decode + [budget]
    assert plan(_tuning_stub("cuda", False, [8, 48, 64], 8192)) == [budget]  # eager: prefill rows only
    assert plan(_tuning_stub("cpu", True, [8, 48, 64], 8192)) == []
    graphs_limit = max(model_runner.PREFILL_GRAPH_MAX_TOKENS, model_runner.PIECEWISE_GRAPH_MAX_TOKENS)
    assert plan(_tuning_stub("cuda", True, [8, 48, 64], graphs_limit)) == decode  # such steps replay graphs
    both = plan(_tuning_stub("cuda", True, [8, 48, 64, 4096], 4096))  # the budget's rows: sustained either way
    assert both == decode + [(4096, True, prefill_mode == 2)]
    monkeypatch.setattr(envs, "KVSERVE_PREFILL_GEMM_TUNING", 0)
    assert plan(_tuning_stub("cuda", True, [8, 48, 64], 8192)) == decode


def _tuning_runner(tiny_model_dir: Callable[..., str], arch: str = "llama") -> ModelRunner:
    """A CPU runner made to look like a CUDA one with decode graphs of 48 and 64 rows (tune_gemms only reads
    the device type, the graph sizes and the model's Linear modules)."""
    args = EngineArgs(model=tiny_model_dir(arch), device="cpu", max_model_len=256, kv_cache_memory="8MiB",
                      dtype="bfloat16")
    runner = EngineCore(args.create_engine_config()).runner
    runner.device = torch.device("cuda")  # only read as a device type below; nothing runs on it
    runner.config = SimpleNamespace(use_cuda_graphs=True, cuda_graph_sizes=[8, 48, 64],  # type: ignore[assignment]
                                    scheduler_config=SimpleNamespace(max_num_batched_tokens=4096))
    return runner


@pytest.mark.parametrize(("fail_late", "timing_mode"), [(False, 1), (False, 2), (True, 1)],
                         ids=["ok", "ok-timing-prefill", "failure"])
def test_tune_gemms_times_each_shape_once_and_keeps_other_engines_choices(
    tiny_model_dir: Callable[..., str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_late: bool,
    timing_mode: int,
) -> None:
    """Each (rows, shape) is tuned once and the results saved; a failure anywhere (here: saving them) drops
    this call's choices (torch's pick runs) but not another engine's, and start-up goes on."""
    from kvserve import envs

    monkeypatch.setattr(envs, "KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(envs, "KVSERVE_GEMM_TUNING", True)
    monkeypatch.setattr(envs, "KVSERVE_PREFILL_GEMM_TUNING", timing_mode)
    cublaslt.clear_tuning()
    earlier = cublaslt.key_of(0, 48, 1, 1, torch.bfloat16, False)  # another engine's decision
    cublaslt._decided[(earlier, True)] = cublaslt.TuneResult(48, 1, 1, False, 1.0, 1.0, -1, 0, 0)
    calls: list[tuple[int, int, int, object]] = []

    def fake_tune(rows: int, weights: list, biases: list, **kwargs: object) -> cublaslt.TuneResult:
        calls.append((rows, weights[0].shape[0], weights[0].shape[1], kwargs["sustained"]))
        assert kwargs["time_missing"] == (not kwargs["sustained"] or timing_mode == 2)
        assert (kwargs["defaults"] is not None) == kwargs["sustained"]  # the shipped choices: prefill rows only
        key = cublaslt.key_of(0, rows, weights[0].shape[0], weights[0].shape[1], weights[0].dtype,
                              biases[0] is not None)
        result = cublaslt.TuneResult(rows, weights[0].shape[0], weights[0].shape[1], biases[0] is not None,
                                     10.0, 9.0, 0, 3, 0)
        cublaslt._decided[(key, True)] = result
        return result

    def failing_save(path: Path, cache: dict) -> None:
        raise RuntimeError("a failure late in the tuning")

    monkeypatch.setattr(cublaslt, "tune", fake_tune)
    if fail_late:
        monkeypatch.setattr(cublaslt, "save_cache", failing_save)
    runner = _tuning_runner(tiny_model_dir)
    shapes = {(m.weight.shape[0], m.weight.shape[1]) for m in runner.model.modules()
              if isinstance(m, Linear)}
    results = runner.tune_gemms()
    # The decode graph sizes timed briefly, the step budget (past the prefill graphs) sustained.
    assert sorted(calls) == sorted((rows, n, k, rows == 4096) for rows in (48, 64, 4096) for n, k in shapes)
    if fail_late:
        assert results == []  # the failure is logged, start-up goes on with torch's pick
        assert cublaslt.decided_keys() == {earlier}  # this call's choices dropped, the earlier engine's kept
    else:
        assert len(results) == len(calls) and not any(r.cached for r in results)
        assert earlier in cublaslt.decided_keys() and len(cublaslt.decided_keys()) == len(calls) + 1
        assert (tmp_path / "gemm_tuning.json").exists()
    cublaslt.clear_tuning()


def test_a_stored_choice_for_this_stack_turns_the_lookups_on(
    tiny_model_dir: Callable[..., str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_lt: dict,
) -> None:
    """With the default lookups only, one stored choice for one of the plan's (rows, shape)s on this stack
    enables the tuning (and its workspace): that shape takes it from the file, untimed, the others run torch's
    picks; a choice stored for another GPU does not."""
    from kvserve import envs

    monkeypatch.setattr(envs, "KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(envs, "KVSERVE_GEMM_TUNING", False)
    monkeypatch.setattr(envs, "KVSERVE_DECODE_GEMM_CHOICES", True)
    monkeypatch.setattr(envs, "KVSERVE_PREFILL_GEMM_TUNING", 1)
    monkeypatch.setattr(cublaslt, "SHIPPED_CHOICES_PATH", None)
    runner = _tuning_runner(tiny_model_dir)
    n, k, has_bias, dtype = next(iter(model_runner.gemm_tuning_groups(runner.model)))
    key = cublaslt.cache_key(torch.device("cuda"), 64, n, k, dtype, has_bias, sustained=True)
    entry = {"choice": cublaslt.TORCH_CHOICE, "algo": None, "torch_us": 10.0, "chosen_us": 10.0}
    cublaslt.save_cache(tmp_path / "gemm_tuning.json", {key.replace("fake GPU", "another GPU"): entry})
    assert not runner.gemm_tuning_enabled() and runner.tune_gemms() == []
    cublaslt.save_cache(tmp_path / "gemm_tuning.json", {key: entry})
    assert runner.gemm_tuning_enabled()
    results = runner.tune_gemms()
    cached = [r for r in results if r.cached]
    assert [(r.rows, r.n, r.k) for r in cached] == [(64, n, k)] and not fake_lt["timed"]
    assert all(r.untimed for r in results if not r.cached)
    cublaslt.clear_tuning()


def test_tune_gemms_tunes_a_row_parallel_layer_as_this_rank_runs_it(
    tiny_model_dir: Callable[..., str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under tensor parallelism a row-parallel layer's bias is added by rank 0 only: on another rank the layer
    runs (and so is tuned) as the shape without a bias, else its tuned plan would never apply there."""
    from kvserve import envs

    monkeypatch.setattr(envs, "KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(envs, "KVSERVE_GEMM_TUNING", True)
    runner = _tuning_runner(tiny_model_dir, "qwen2")
    with_bias = [m for m in runner.model.modules() if isinstance(m, Linear) and m.bias is not None]
    assert with_bias  # Qwen2's q/k/v projections
    for module in with_bias:  # as if row-parallel on rank 1 of 2
        module.row_parallel, module.tp_rank = True, 1
    calls: list[tuple[int, int, bool]] = []

    def fake_tune(rows: int, weights: list, biases: list, **kwargs: object) -> cublaslt.TuneResult:
        calls.append((weights[0].shape[0], weights[0].shape[1], biases[0] is not None))
        return cublaslt.TuneResult(rows, weights[0].shape[0], weights[0].shape[1], biases[0] is not None,
                                   10.0, 10.0, cublaslt.TORCH_CHOICE, 0, 0)

    monkeypatch.setattr(cublaslt, "tune", fake_tune)
    runner.tune_gemms()
    n, k = with_bias[0].weight.shape
    assert calls and (n, k, False) in calls and not any(has_bias for *_, has_bias in calls)


@pytest.mark.parametrize("timing_mode", [1, 2])
def test_default_start_times_nothing_and_writes_nothing_without_a_stored_choice(
    tiny_model_dir: Callable[..., str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_lt: dict,
    timing_mode: int,
) -> None:
    """tune_gemms with the real tune(): KVSERVE_PREFILL_GEMM_TUNING=1 and no stored or shipped choice for the
    stack and shapes does nothing (no lookups, no cuBLASLt workspace: `gemm_tuning_enabled` is false) and
    writes no file; 2 times the step budget's rows sustained and stores the choices, and looks the decode graph
    sizes (48, 64) up without timing them."""
    from kvserve import envs

    monkeypatch.setattr(envs, "KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(envs, "KVSERVE_GEMM_TUNING", False)
    monkeypatch.setattr(envs, "KVSERVE_DECODE_GEMM_CHOICES", True)
    monkeypatch.setattr(envs, "KVSERVE_PREFILL_GEMM_TUNING", timing_mode)
    fake_lt["times"].update({cublaslt.TORCH_CHOICE: 100.0, 0: 90.0, 1: 80.0, 2: 95.0})
    runner = _tuning_runner(tiny_model_dir)
    assert runner.gemm_tuning_enabled() == (timing_mode == 2)
    results = runner.tune_gemms()
    if timing_mode == 1:
        assert results == [] and not fake_lt["timed"] and not list(tmp_path.iterdir()) and cublaslt.num_tuned() == 0
    else:
        assert {r.rows for r in results} == {48, 64, 4096}
        decode = [r for r in results if r.rows != 4096]
        budget = [r for r in results if r.rows == 4096]
        assert decode and all(r.untimed and r.choice == cublaslt.TORCH_CHOICE for r in decode)
        assert budget and all(not r.untimed and r.choice == 1 for r in budget)
        assert len(fake_lt["sustained_calls"]) == len(budget)
        stored = cublaslt.load_cache(tmp_path / "gemm_tuning.json")
        assert len(stored) == len(budget) and all(key.endswith("|sustained") and "|4096x" in key for key in stored)
    cublaslt.clear_tuning()


def test_a_default_engine_on_the_measured_stack_finds_a_shipped_choice_for_every_planned_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the stack the shipped choices were measured on (the H200's name and library versions, stood in for
    on the CPU), a default engine of the Qwen2.5-7B shape with nothing stored counts its start-up tuning as
    enabled, and every (rows, shape) of its plan has a shipped choice: the keys its enabled check and its
    lookups build (`cublaslt.cache_key`) are the shipped file's, for the default graph sizes and step budget."""
    import json

    from kvserve import envs
    from kvserve.model.arch import load_arch_config
    from kvserve.model.registry import get_model_class

    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
              "intermediate_size": 18944, "num_hidden_layers": 2, "num_attention_heads": 28,
              "num_key_value_heads": 4, "max_position_embeddings": 32768, "rope_theta": 1e6,
              "rms_norm_eps": 1e-6, "vocab_size": 152064, "tie_word_embeddings": False, "hidden_act": "silu"}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(envs, "KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(envs, "KVSERVE_GEMM_TUNING", False)
    monkeypatch.setattr(envs, "KVSERVE_DECODE_GEMM_CHOICES", True)
    monkeypatch.setattr(envs, "KVSERVE_PREFILL_GEMM_TUNING", 1)
    monkeypatch.setattr(cublaslt, "_device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(cublaslt, "library_version", lambda: 130100)
    monkeypatch.setattr(cublaslt, "_reduced_precision_allowed", lambda dtype: True)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", lambda *args: "_BlasBackend.Cublaslt")

    engine_config = EngineArgs(model=str(tmp_path / "model"), load_format="dummy", device="cpu",
                               dtype="bfloat16").create_engine_config()
    stub = _tuning_stub("cuda", True, list(engine_config.cuda_graph_sizes),
                        engine_config.scheduler_config.max_num_batched_tokens)
    arch = load_arch_config(str(tmp_path / "model"))
    with torch.device("meta"):
        model = get_model_class(arch.architecture)(arch, torch.bfloat16)
    stub.model = model
    stub.gemm_tuning_plan = lambda: ModelRunner.gemm_tuning_plan(stub)  # type: ignore[arg-type]
    stub._gemm_tuning_can_register = (  # type: ignore[attr-defined]
        lambda plan, groups, stored: ModelRunner._gemm_tuning_can_register(stub, plan, groups, stored))  # type: ignore[arg-type]

    plan = stub.gemm_tuning_plan()
    groups = model_runner.gemm_tuning_groups(model)
    assert [rows for rows, *_ in plan] == [48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256, 8192]
    assert all(sustained and not time_missing for _, sustained, time_missing in plan)
    assert sorted((n, k, bias) for n, k, bias, _ in groups) == [
        (3584, 3584, False), (3584, 18944, False), (4608, 3584, True), (37888, 3584, False)]
    assert ModelRunner.gemm_tuning_enabled(stub)  # type: ignore[arg-type]
    shipped = cublaslt.shipped_choices()
    missing = [(rows, n, k) for rows, sustained, _ in plan for n, k, bias, dtype in groups
               if cublaslt.cache_key(torch.device("cuda"), rows, n, k, dtype, bias,
                                     model_runner.GEMM_TUNING_TORCH_CANDIDATE, sustained) not in shipped]
    assert missing == []
    # Another GPU of the same stack finds none of them: the engine there reserves and looks up nothing.
    monkeypatch.setattr(cublaslt, "_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert not ModelRunner.gemm_tuning_enabled(stub)  # type: ignore[arg-type]
