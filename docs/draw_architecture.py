"""Draws docs/architecture.svg: the request path, and the adapter states as adapter_state.py defines them.

    .venv/bin/python docs/draw_architecture.py          # rewrites docs/architecture.svg

The state diagram's arrows are read from `TRANSITIONS`, so the picture cannot drift from the code.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

from loraserve.lora.adapter_state import TRANSITIONS, AdapterState

OUTPUT = Path(__file__).with_name("architecture.svg")

# The request path, top to bottom: (x, y, label); arrows join consecutive boxes of a column.
REQUEST_PATH = [
    (0.5, 0.93, "HTTP client\nOpenAI /v1/*, LoRAX /generate, admin /admin/*"),
    (0.5, 0.78, "server/  (FastAPI routes, auth, tenants)\nAdapterCatalog: registry DB + files"),
    (0.5, 0.63, "AsyncLLMEngine  (the facade; engine thread)\none step at a time, streams back per request"),
    (0.5, 0.48, "LLMEngine: Scheduler (fair share, admission)\nBlockManager (paged KV, prefix cache)"),
    (0.5, 0.33, "ModelRunner: one forward pass for the batch\nLlama layers + LoraBackend (one per engine)"),
    (0.5, 0.15, "MemoryPool: pages shared by KV blocks and adapter rows\n(PageAllocator in memory/)"),
]
SIDE = (0.5, 0.015, "AdapterManager (loader thread): disk -> host cache -> device slot; the adapter records")

# Where each state sits in the right panel.
STATE_PLACES = {
    AdapterState.REGISTERED: (0.12, 0.78),
    AdapterState.READING: (0.45, 0.95),
    AdapterState.ON_HOST: (0.85, 0.78),
    AdapterState.LOADING: (0.45, 0.5),
    AdapterState.ON_DEVICE: (0.85, 0.3),
    AdapterState.FAILED: (0.12, 0.4),
    AdapterState.DELETED: (0.45, 0.08),
}


def box(ax: Axes, x: float, y: float, text: str, color: str) -> None:
    style = {"boxstyle": "round,pad=0.5", "facecolor": color, "edgecolor": "#444"}
    ax.text(x, y, text, ha="center", va="center", fontsize=9, bbox=style)


Point = tuple[float, float]


def arrow(ax: Axes, start: Point, end: Point, bend: float = 0.0, color: str = "#333") -> None:
    ax.annotate(
        "", xy=end, xytext=start,
        arrowprops={"arrowstyle": "-|>", "color": color, "shrinkA": 22, "shrinkB": 22,
                    "connectionstyle": f"arc3,rad={bend}"},
    )  # fmt: skip


def draw_request_path(ax: Axes) -> None:
    ax.set_title("The request path", fontsize=12)
    for (x, y, _), (_, below, _) in itertools.pairwise(REQUEST_PATH):
        arrow(ax, (x, y), (x, below))
    arrow(ax, SIDE[:2], REQUEST_PATH[-1][:2])  # it writes adapter rows into pages of the pool
    for x, y, text in REQUEST_PATH:
        box(ax, x, y, text, "#e8f0fe")
    box(ax, *SIDE, "#fef7e0")


def draw_states(ax: Axes) -> None:
    ax.set_title("One adapter's states (lora/adapter_state.py)", fontsize=12)
    for source, targets in TRANSITIONS.items():
        for target in targets:
            back = source in TRANSITIONS[target]  # a pair of opposite moves: bend both apart
            grey = target is AdapterState.DELETED  # any state may be deleted
            color = "#bbb" if grey else "#b3261e" if target is AdapterState.FAILED else "#333"
            arrow(ax, STATE_PLACES[source], STATE_PLACES[target], 0.2 if back else 0.05, color)
    for state, (x, y) in STATE_PLACES.items():
        box(ax, x, y, state.value.upper(), "#fce8e6" if state is AdapterState.FAILED else "#e6f4ea")
    ax.text(0.5, 0.0, "grey: unregistered; red: unreadable or changed on disk; `draining` is a flag over the states",
            ha="center", fontsize=8)  # fmt: skip


def main() -> None:
    figure, (left, right) = plt.subplots(1, 2, figsize=(15, 7.5))
    for ax in (left, right):
        ax.set_xlim(0, 1)
        ax.set_ylim(-0.03, 1)
        ax.axis("off")
    draw_request_path(left)
    draw_states(right)
    figure.tight_layout()
    output = Path(sys.argv[1]) if len(sys.argv) > 1 else OUTPUT
    # Text as text (searchable, small), a fixed hash salt and no date: the same code draws the same file.
    matplotlib.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "loraserve"})
    figure.savefig(output, format="svg", metadata={"Date": None})
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
