"""`--plot FILE.png`: latency CDFs (TTFT, ITL, E2E), throughput over time, and the sampled server metrics.

A sweep draws every run in each panel (one colour per run). matplotlib is imported here only, with the
Agg backend (no display needed).
"""

from __future__ import annotations

import numpy as np

from kvserve.bench.client import RequestRecord
from kvserve.bench.results import RunResult

# Throughput-over-time bins: about this many over the run, at most 1 s wide and at least 10 ms.
TARGET_BINS = 40
MAX_BIN_S = 1.0
MIN_BIN_S = 0.01


def output_token_times(records: list[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """(chunk arrival times in s since the run start, output tokens credited to each chunk) over the
    successful requests. A request's tokens are spread evenly over its text chunks (the usage count is
    only known at the end of the stream)."""
    times: list[float] = []
    weights: list[float] = []
    for r in records:
        if not r.success or r.ttft_s is None or not r.output_tokens:
            continue
        arrivals = r.start_s + r.ttft_s + np.concatenate([[0.0], np.cumsum(r.itl_s)])
        times.extend(arrivals.tolist())
        weights.extend([r.output_tokens / len(arrivals)] * len(arrivals))
    return np.asarray(times), np.asarray(weights)


def throughput_series(records: list[RequestRecord], bin_s: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(bin edges, output tokens/s in each bin): one more edge than values. The bin width defaults to
    about 1/TARGET_BINS of the run, clipped to [MIN_BIN_S, MAX_BIN_S]."""
    times, weights = output_token_times(records)
    if times.size == 0:
        return np.zeros(0), np.zeros(0)
    if bin_s is None:
        bin_s = float(np.clip(times.max() / TARGET_BINS, MIN_BIN_S, MAX_BIN_S))
    num_bins = max(1, int(np.ceil(times.max() / bin_s)))
    edges = np.arange(num_bins + 1) * bin_s
    edges[-1] = max(edges[-1], times.max())  # rounding must not leave the last token outside
    # The last token lands on the last edge at most: histogram's last bin is closed on the right.
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    return edges, counts / bin_s


def _cdf(ax: object, values_ms: list[float], label: str) -> None:
    if not values_ms:
        return
    x = np.sort(np.asarray(values_ms))
    y = np.arange(1, x.size + 1) / x.size
    ax.step(x, y, where="post", label=label)  # type: ignore[attr-defined]


def plot_runs(runs: list[RunResult], path: str, title: str | None = None) -> None:
    """Write the figure of `runs` to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_server = any(run.server_samples for run in runs)
    rows = 3 if with_server else 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4 * rows), squeeze=False)
    panels = (
        (axes[0][0], "TTFT (ms)", "fraction of requests", lambda r: [r.ttft_s * 1e3] if r.ttft_s is not None else []),
        (axes[0][1], "inter-token latency (ms)", "fraction of gaps", lambda r: [g * 1e3 for g in r.itl_s]),
        (axes[1][0], "end-to-end latency (ms)", "fraction of requests",
         lambda r: [r.e2e_s * 1e3] if r.e2e_s is not None else []),
    )
    for ax, xlabel, ylabel, values in panels:
        for run in runs:
            _cdf(ax, [v for r in run.records if r.success for v in values(r)], run.label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
    ax = axes[1][1]
    for run in runs:
        edges, tput = throughput_series(run.records)
        if tput.size:
            # Repeat the last value so that the last bin is drawn to its right edge.
            ax.step(edges, np.append(tput, tput[-1]), where="post", label=run.label)
    ax.set_xlabel("time since run start (s)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    if with_server:
        ax_req, ax_kv = axes[2][0], axes[2][1]
        for run in runs:
            samples = run.server_samples
            t = [s.t_s for s in samples]
            if any(s.running is not None for s in samples):
                ax_req.plot(t, [s.running for s in samples], label=f"{run.label} running")
            if any(s.waiting is not None for s in samples):
                ax_req.plot(t, [s.waiting for s in samples], linestyle="--", label=f"{run.label} waiting")
            if any(s.kv_usage is not None for s in samples):
                ax_kv.plot(t, [100.0 * s.kv_usage if s.kv_usage is not None else None for s in samples],
                           label=run.label)
        ax_req.set_xlabel("time since run start (s)")
        ax_req.set_ylabel("server requests")
        ax_kv.set_xlabel("time since run start (s)")
        ax_kv.set_ylabel("server KV cache usage (%)")
        for a in (ax_req, ax_kv):
            a.grid(alpha=0.3)
    for row in axes:
        for a in row:
            if a.get_legend_handles_labels()[0]:
                a.legend(fontsize="small")
    fig.suptitle(title or "kvserve bench")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
