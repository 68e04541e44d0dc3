"""PNG figures (matplotlib, Agg backend) of one run and of sweeps of runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from peerinfer.sim.metrics import subject_shares
from peerinfer.sim.simulator import Simulation


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_") or "label"


def plot_shares(
    ends: Sequence[int],
    shares: Sequence[Sequence[float]],
    path: str | Path,
    title: str,
    *,
    ax: Any = None,
    highlight: float = 0.15,
) -> None:
    """Per-node share of one subject over time: one line per node; nodes that never reach
    ``highlight`` share are drawn thin and grey."""
    plt = _plt()
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(8, 3.6))
    nodes = len(shares[0]) if shares else 0
    for k in range(nodes):
        ys = [w[k] for w in shares]
        if max(ys, default=0.0) >= highlight:
            ax.plot(ends, ys, linewidth=1.4, label=f"node {k}")
        else:
            ax.plot(ends, ys, linewidth=0.6, color="0.75")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("requests (end of a 300-request window)")
    ax.set_ylabel("share of the subject's requests")
    ax.set_title(title, fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    if 0 < len(labels) <= 10:
        ax.legend(fontsize=7, loc="upper right", ncol=2)
    if own:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def plot_holders(holders: Sequence[Sequence[Any]], nodes: int, ax: Any, title: str) -> None:
    """A raster: a mark at (request, node) when that node caches the subject's whole prefix."""
    xs = [i for i, held in holders for _ in held]
    ys = [k for _, held in holders for k in held]
    ax.scatter(xs, ys, s=2, marker="s", color="tab:blue", linewidths=0)
    ax.set_ylim(-0.5, nodes - 0.5)
    ax.set_xlabel("requests")
    ax.set_ylabel("node")
    ax.set_title(title, fontsize=10)


def run_figures(sim: Simulation, summary: Mapping[str, Any], directory: str | Path) -> list[Path]:
    """Figures of one run: the top subject's per-node share over time, the TTFT distribution and
    the per-node load. Returns the paths written."""
    plt = _plt()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    cfg = sim.config
    paths: list[Path] = []
    labels = [sim.workload[i % len(sim.workload)].label for i in range(sim.total)]
    subject = (summary.get("specialization") or {}).get("subject")
    tag = f"{cfg.policy}, {cfg.nodes} nodes, delay {cfg.delay.spec()} ms, {cfg.skew}"
    if subject:
        ends, shares = subject_shares(
            labels, sim.server, cfg.nodes, subject, cfg.share_window, cfg.share_stride
        )
        p = out / f"share_{_slug(subject)}.png"
        plot_shares(ends, shares, p, f"per-node share of '{subject}' ({tag})")
        paths.append(p)

    done = [i for i in range(sim.total) if sim.status[i] == 1]
    ttft = sorted(sim.first[i] - sim.arrival[i] for i in done)
    lat = sorted(sim.finish[i] - sim.arrival[i] for i in done)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if ttft:
        ys = [(j + 1) / len(ttft) for j in range(len(ttft))]
        ax.plot(ttft, ys, label="TTFT")
        ax.plot(lat, ys, label="latency")
        ax.set_xscale("log")
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT and latency CDF ({tag})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    p = out / "latency_cdf.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(max(5, cfg.nodes * 0.12 + 3), 3.4))
    ks = list(range(cfg.nodes))
    ax.bar(ks, sim.served, color="tab:blue", label="served")
    ax.set_xlabel("node")
    ax.set_ylabel("requests served")
    ax2 = ax.twinx()
    util = [n["utilization"] or 0.0 for n in summary["nodes"]]
    ax2.plot(ks, util, "o", color="tab:red", markersize=3, label="utilization")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("utilization")
    ax.set_title(f"per-node load ({tag})", fontsize=9)
    fig.tight_layout()
    p = out / "node_load.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


__all__ = ["plot_holders", "plot_shares", "run_figures"]
