"""``inspect ... job.picture=<file.png>``: a layout drawn, for a user who would rather look than
read a table of offsets. One panel per tensor, its dims folded to rows x columns (leading dims
stacked as rows: an expert tensor ``[E, out, in]`` is E bands of ``out`` rows, thin lines between
them); each box a rank
holds is a rectangle coloured by that rank and labelled with every rank holding it; a tensor
held whole by every rank is grey and hatched ("replicated"). Needs matplotlib (the ``report``
extra), checked before anything is drawn."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import math
import os

from .dcp import ConfigError

MAX_PANELS = 48


_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


def check_available(path: str | None = None) -> None:
    """Before anything is read: matplotlib is there and ``path`` names a format it draws."""
    if path is not None and os.path.splitext(path)[1].lower() not in _FORMATS:
        raise ConfigError(f"job.picture: {path}: the picture is drawn as {', '.join(_FORMATS)} (by its extension)")
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("job.picture: drawing needs matplotlib: pip install 'hpdcp_runner[report]'")


def _rects(offsets: list[int], sizes: list[int], shape: list[int]) -> list[tuple[int, int, int, int]]:
    """A box of an N-D tensor as (x, y, width, height) rectangles on the 2-D picture of it: the
    last dim is the columns, the others are folded into rows (row-major), so a box of a 3-D
    tensor is one rectangle per leading index it spans (e.g. per expert)."""
    if not shape:
        return [(0, 0, 1, 1)]
    if len(shape) == 1:
        return [(offsets[0], 0, sizes[0], 1)]
    lead = list(itertools.product(*(range(o, o + n) for o, n in zip(offsets[:-2], sizes[:-2]))))
    if len(lead) > 4096:  # too many bands to draw one by one: their bounding band
        return [(offsets[-1], _flat(offsets[:-2], shape[:-2]) * shape[-2] + offsets[-2], sizes[-1],
                 math.prod(sizes[:-1]))]
    return [(offsets[-1], _flat(list(i), shape[:-2]) * shape[-2] + offsets[-2], sizes[-1], sizes[-2]) for i in lead]


def _flat(index: list[int], shape: list[int]) -> int:
    r = 0
    for o, n in zip(index, shape):
        r = r * n + o
    return r


def draw(report: dict, path: str, title: str) -> str:
    """Draw ``report`` (inspect's layout report) to ``path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    tensors = [(k, t) for k, t in sorted(report["tensors"].items()) if t["shards"]]
    shown = tensors[:MAX_PANELS]
    cols = min(4, max(1, len(shown)))
    rows = max(1, math.ceil(len(shown) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows + 0.8), squeeze=False)
    cmap = plt.get_cmap("tab20")
    ranks = report["ranks"]
    for ax, (key, t) in zip(axes.flat, shown):
        shape = t.get("shape") or []
        width = shape[-1] if shape else 1
        height = math.prod(shape[:-1]) if len(shape) > 1 else 1
        holders: dict[tuple, list[int]] = {}
        for r, x in enumerate(t["shards"]):
            boxes = [] if not x else [x] if len(x) == 2 and all(isinstance(v, int) for v in x[0] + x[1]) else x
            for o, s in boxes:
                holders.setdefault((tuple(o), tuple(s)), []).append(r)
        replicated = len(holders) == 1 and len(next(iter(holders.values()))) == ranks and \
            list(next(iter(holders))[1]) == list(shape)
        for (o, s), who in holders.items():
            if replicated:
                ax.add_patch(Rectangle((0, 0), width, height, facecolor="0.85", edgecolor="0.4", hatch="//"))
                ax.text(width / 2, height / 2, f"replicated on all {ranks}", ha="center", va="center", fontsize=8)
                continue
            label = "r" + ",".join(map(str, who)) if len(who) <= 4 else f"r{who[0]}..{who[-1]} ({len(who)})"
            for x0, y0, w, h in _rects(list(o), list(s), list(shape)):
                ax.add_patch(Rectangle((x0, y0), w, h, facecolor=cmap(who[0] % 20), edgecolor="black", alpha=0.85,
                                       linewidth=0.6))
                if w * h >= 0.01 * width * height:
                    ax.text(x0 + w / 2, y0 + h / 2, label, ha="center", va="center", fontsize=7)
        for band in range(1, height // shape[-2] if len(shape) > 2 else 1):  # where each leading index starts
            ax.axhline(band * shape[-2], color="black", linewidth=1.2)
        ax.set_xlim(0, width)
        ax.set_ylim(height, 0)
        rule = f"rules[{t['rule']}]" if t["rule"] is not None else "no rule: R"
        name = key if len(key) <= 44 else "..." + key[-41:]
        ax.set_title(f"{name}\n{shape} {','.join(t['placements'])} ({rule})", fontsize=7)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    more = f" (first {MAX_PANELS} of {len(tensors)} tensors)" if len(tensors) > MAX_PANELS else ""
    fig.suptitle(f"{title}: layout {report['name']} at {ranks} ranks, mesh {report['mesh']}{more}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    # drawn to a fresh file beside it, then renamed over the name: a link planted at the name
    # is replaced, never followed (its target is never written)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "xb") as f:
            fig.savefig(f, dpi=110, format=_FORMATS[os.path.splitext(path)[1].lower()])
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    plt.close(fig)
    return path
