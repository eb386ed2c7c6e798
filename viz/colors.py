"""One fixed fill colour per executor, so the same executor looks the same in every picture."""
from __future__ import annotations

KNOWN = {
    "inductor": "#ffbe7d",  # orange
    "nvfuser": "#a8d86e",   # green
    "te": "#9ecae9",        # blue
    "torch": "#d9d9d9",     # grey: eager's kernels, whatever nobody else claimed
}
# for executors of your own, in the order they first appear (repeats after the last one)
OTHERS = ("#f4a6a6", "#c5b0d5", "#fde089", "#a6dcd5", "#e6c7a1", "#f7b6d2", "#c7e9c0")


def executor_colors(names) -> dict[str, str]:
    """`{executor: fill}` for the executors in `names` (in order, duplicates ignored)."""
    colors, spare = {}, 0
    for name in dict.fromkeys(names):
        if name in KNOWN:
            colors[name] = KNOWN[name]
        else:
            colors[name] = OTHERS[spare % len(OTHERS)]
            spare += 1
    return colors
