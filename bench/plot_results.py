"""The pictures and the README table of the benchmarks' current figures, drawn from bench/results/.

    python bench/plot_results.py              # writes docs/bench_*.svg
    python bench/plot_results.py --table      # prints README's H100 model table

Everything here reads the results files that the benchmarks write (``bench/_results.py``) and
nothing else, so a picture always shows the figures the files hold, with their machine and
date: rerun a benchmark, then this script, and commit both. Three pictures, where a reader would
rather look than read: the example model's step times (README and bench/RESULTS.md), where our
attention stands against cuDNN, and the fused loss's speed against its memory.

Needs matplotlib (``pip install ".[bench]"``); the table needs nothing beyond the standard library.
The SVGs keep their text as text and carry no date, so redrawing unchanged figures changes no
byte.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from _results import read_results

DOCS = Path(__file__).resolve().parents[1] / "docs"
MODELS = (("1 document per row", "bench_model"), ("4 documents per row", "bench_model.packed"))
TUNED = "ejlabel, tuned in context"  # the tuned rows' variants start so: "... (defaults)", "... (hand-set)"


def provenance(record: dict[str, Any]) -> str:
    """Device and date of a record, as a picture's caption says them."""
    machine, versions = record["machine"], record["versions"]
    return f"{machine.get('device') or machine.get('cpu')}, jax {versions['jax']}, {record['date'][:10]}"


def model_table() -> str:
    """README's table: both example models' step times against plain JAX, from their results files;
    where a file also times the plain model on cuDNN's packed layout (the packed model's second
    baseline), two more columns give the ratios to it."""
    records = [(model, read_results(name)["rows"]) for model, name in MODELS]
    layout = any("train_vs_packed_layout" in row for _, rows in records for row in rows)
    lines = [
        "| model | variant | train step ms | vs plain | serve step ms | vs plain |" + (" train vs packed layout | serve vs packed layout |" if layout else ""),
        "|---|---|---:|---:|---:|---:|" + ("---:|---:|" if layout else ""),
    ]
    for model, rows in records:
        for index, row in enumerate(rows):
            tuned = row["variant"].startswith(TUNED) and isinstance(row.get("tune_s"), (int, float))
            variant = row["variant"] + (f" ({row['tune_s']:.0f} s)" if tuned else "")
            line = (
                f"| {model if index == 0 else ''} | {variant} | {row['train_ms']:.2f} | {row['train_vs_plain']:.3f}x "
                f"| {row['serve_ms']:.2f} | {row['serve_vs_plain']:.3f}x |"
            )
            if "train_vs_packed_layout" in row:
                line += f" {row['train_vs_packed_layout']:.3f}x | {row['serve_vs_packed_layout']:.3f}x |"
            elif layout:
                line += " | |"
            lines.append(line)
    return "\n".join(lines)


def draw_model(plt: Any, out: Path) -> Path:
    """Training step time of every variant of both models, the ratio to plain JAX beside each bar."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2), sharey=True)
    for ax, (model, name) in zip(axes, MODELS):
        record = read_results(name)
        rows = record["rows"]
        labels = [row["variant"].replace("ejlabel, ", "") for row in rows]
        # Grey for the plain baselines (two with packed documents), dark blue for the tuned rows.
        colors = ["#888888" if row["variant"].startswith("plain JAX") else ("#2a7ab9" if row["variant"].startswith(TUNED) else "#9cc3e4") for row in rows]
        bars = ax.barh(labels, [row["train_ms"] for row in rows], color=colors)
        for bar, row in zip(bars, rows):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {row['train_vs_plain']:.3f}x", va="center", fontsize=8)
        ax.set_title(f"{model}\n{provenance(record)}", fontsize=9)
        ax.set_xlabel("training step, ms; beside each bar: plain time / its time", fontsize=8)
        ax.set_xlim(0, max(row["train_ms"] for row in rows) * 1.25)
    axes[0].invert_yaxis()  # once: the panels share the axis; plain JAX on top
    fig.suptitle("Example decoder, 125M parameters: plain JAX against ejlabel", fontsize=10)
    return save(fig, out / "bench_model.svg")


def draw_attention(plt: Any, out: Path) -> Path:
    """Our two attention kernels' speed against cuDNN's (time ratio) at the sections' headline shapes."""
    shapes = (
        ("bench_attention.a", "causal B4 S4096 H16 D128", "cudnn"),
        ("bench_attention.d", "causal B2 S4096 H8 D256", "cudnn"),
        ("bench_attention.c", "packed B8 S2048 H12/4 D64 x4 random docs", "cudnn packed layout"),
    )
    fig, axes = plt.subplots(1, 2, figsize=(10, 2.8), sharey=True)
    dates = set()
    for ax, pass_ in zip(axes, ("fwd", "fwd+bwd")):
        labels, mosaic, triton = [], [], []
        for name, case, anchor in shapes:
            record = read_results(name)
            dates.add(provenance(record))
            # The files' own ratios: TFLOP/s over the anchor's, from unrounded times.
            ratio = {row["impl"]: row["ratio"] for row in record["rows"] if row["case"] == case and row["pass"] == pass_ and row["versus"]}
            labels.append(case + ("\n(against cuDNN's packed layout)" if anchor != "cudnn" else ""))
            mosaic.append(ratio["mosaic"])
            triton.append(ratio["pallas"])
        ys = range(len(labels))
        ax.barh([y - 0.2 for y in ys], mosaic, height=0.4, label="Mosaic GPU (ours)", color="#2a7ab9")
        ax.barh([y + 0.2 for y in ys], triton, height=0.4, label="Pallas Triton (ours)", color="#9cc3e4")
        for y, m, t in zip(ys, mosaic, triton):
            ax.text(m, y - 0.2, f" {m:.2f}x", va="center", fontsize=8)
            ax.text(t, y + 0.2, f" {t:.2f}x", va="center", fontsize=8)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xticks([0.5, 1, 2, 4, 8], ["0.5", "1", "2", "4", "8"])
        ax.set_xticks([], minor=True)
        ax.set_yticks(list(ys), labels, fontsize=8)
        ax.set_title(f"{pass_}: our speed / cuDNN's", fontsize=9)
    axes[0].invert_yaxis()  # once: the panels share the axis
    axes[1].legend(fontsize=8, loc="center right")
    fig.suptitle("Attention, bf16, against cuDNN in the same run (" + "; ".join(sorted(dates)) + ")", fontsize=10)
    return save(fig, out / "bench_attention.svg")


def draw_loss(plt: Any, out: Path) -> Path:
    """The fused linear cross-entropy: speed against temporary memory, both relative to plain JAX."""
    record = read_results("bench_linear_cross_entropy")
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.fill_between([0.05, 1 / 8], 1.3, 1.45, color="#e6f2e6", zorder=0)
    ax.text(0.052, 1.44, "goal: >= 1.3x at <= 1/8 of the memory", fontsize=8, va="top", color="#4a8a4a")
    styles = {"rows kernel": ("#2a7ab9", "token chunks, the rows kernel"), "token chunks": ("#9cc3e4", "token chunks, XLA's passes"), "": ("#888888", None)}
    for row in record["rows"]:
        kind = next(k for k in styles if k in row["variant"])
        color, legend = styles[kind]
        chunk = row["variant"].split(",")[1].split()[-1] if kind else row["variant"].removeprefix("ours, ").split(" (")[0]
        ax.scatter(row["memory_vs_plain"], row["speed_vs_plain"], color=color, zorder=2, label=legend)
        styles[kind] = (color, None)  # one legend entry per kind
        ax.annotate(chunk, (row["memory_vs_plain"], row["speed_vs_plain"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlim(0.05, 1.6)
    ax.set_xticks([0.0625, 0.125, 0.25, 0.5, 1], ["1/16", "1/8", "1/4", "1/2", "1"])
    ax.set_xticks([], minor=True)
    ax.set_xlabel("temporary memory / plain's")
    ax.set_ylabel("speed / plain's (fwd+bwd)")
    ax.legend(fontsize=7, loc="upper right", title="labels: tokens per chunk", title_fontsize=7)
    ax.set_title(f"Linear cross-entropy [16384, 768] x [768, 32000], bf16\n{provenance(record)}", fontsize=9)
    return save(fig, out / "bench_linear_cross_entropy.svg")


def save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None})
    print(f"wrote {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="store_true", help="print README's H100 model table and draw nothing")
    parser.add_argument("--out", type=Path, default=DOCS, help="folder for the SVGs (default: docs/)")
    args = parser.parse_args(argv)
    if args.table:
        print(model_table())
        return 0
    import matplotlib

    matplotlib.use("svg")
    matplotlib.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "ejlabel"})
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    for draw in (draw_model, draw_attention, draw_loss):
        draw(plt, args.out)
        plt.close("all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
