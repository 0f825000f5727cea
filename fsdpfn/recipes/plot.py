"""Reward and loss curves as a PNG, with no plotting dependency.

``plot_metrics(metrics.jsonl, out.png, phase)`` uses matplotlib when it is importable and
otherwise draws the curves itself into an RGB pixel buffer written by a tiny PNG encoder
(zlib + struct, 8-bit RGB, filter 0). Either way the PNG is produced.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path

__all__ = ["plot_metrics", "read_metrics", "write_png", "Canvas"]

# 5x7 bitmap glyphs, one string of 5 chars per row ("#" = ink)
_FONT = {
    "0": [" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "],
    "1": ["  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "],
    "2": [" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"],
    "3": ["#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "],
    "4": ["   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "],
    "5": ["#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "],
    "6": ["  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "],
    "7": ["#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "],
    "8": [" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "],
    "9": [" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "],
    "A": [" ### ", "#   #", "#   #", "#####", "#   #", "#   #", "#   #"],
    "B": ["#### ", "#   #", "#   #", "#### ", "#   #", "#   #", "#### "],
    "C": [" ### ", "#   #", "#    ", "#    ", "#    ", "#   #", " ### "],
    "D": ["#### ", "#   #", "#   #", "#   #", "#   #", "#   #", "#### "],
    "E": ["#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#####"],
    "F": ["#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#    "],
    "G": [" ### ", "#   #", "#    ", "# ###", "#   #", "#   #", " ####"],
    "H": ["#   #", "#   #", "#   #", "#####", "#   #", "#   #", "#   #"],
    "I": [" ### ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "],
    "J": ["  ###", "   # ", "   # ", "   # ", "   # ", "#  # ", " ##  "],
    "K": ["#   #", "#  # ", "# #  ", "##   ", "# #  ", "#  # ", "#   #"],
    "L": ["#    ", "#    ", "#    ", "#    ", "#    ", "#    ", "#####"],
    "M": ["#   #", "## ##", "# # #", "# # #", "#   #", "#   #", "#   #"],
    "N": ["#   #", "#   #", "##  #", "# # #", "#  ##", "#   #", "#   #"],
    "O": [" ### ", "#   #", "#   #", "#   #", "#   #", "#   #", " ### "],
    "P": ["#### ", "#   #", "#   #", "#### ", "#    ", "#    ", "#    "],
    "Q": [" ### ", "#   #", "#   #", "#   #", "# # #", "#  # ", " ## #"],
    "R": ["#### ", "#   #", "#   #", "#### ", "# #  ", "#  # ", "#   #"],
    "S": [" ####", "#    ", "#    ", " ### ", "    #", "    #", "#### "],
    "T": ["#####", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  "],
    "U": ["#   #", "#   #", "#   #", "#   #", "#   #", "#   #", " ### "],
    "V": ["#   #", "#   #", "#   #", "#   #", "#   #", " # # ", "  #  "],
    "W": ["#   #", "#   #", "#   #", "# # #", "# # #", "# # #", " # # "],
    "X": ["#   #", "#   #", " # # ", "  #  ", " # # ", "#   #", "#   #"],
    "Y": ["#   #", "#   #", " # # ", "  #  ", "  #  ", "  #  ", "  #  "],
    "Z": ["#####", "    #", "   # ", "  #  ", " #   ", "#    ", "#####"],
    ".": ["     ", "     ", "     ", "     ", "     ", " ##  ", " ##  "],
    "-": ["     ", "     ", "     ", "#####", "     ", "     ", "     "],
    "+": ["     ", "  #  ", "  #  ", "#####", "  #  ", "  #  ", "     "],
    ":": ["     ", " ##  ", " ##  ", "     ", " ##  ", " ##  ", "     "],
    "/": ["    #", "    #", "   # ", "  #  ", " #   ", "#    ", "#    "],
    "(": ["   # ", "  #  ", " #   ", " #   ", " #   ", "  #  ", "   # "],
    ")": [" #   ", "  #  ", "   # ", "   # ", "   # ", "  #  ", " #   "],
    "_": ["     ", "     ", "     ", "     ", "     ", "     ", "#####"],
    "=": ["     ", "     ", "#####", "     ", "#####", "     ", "     "],
    " ": ["     "] * 7,
}

WHITE, BLACK, GREY = (255, 255, 255), (40, 40, 40), (215, 215, 215)
BLUE, ORANGE, GREEN = (31, 119, 180), (255, 127, 14), (44, 160, 44)
RED, PURPLE = (214, 39, 40), (148, 103, 189)


def write_png(path: str | Path, width: int, height: int, rgb: bytes | bytearray) -> Path:
    """Write 8-bit RGB pixels (row-major, ``width*height*3`` bytes) as a PNG file."""
    if len(rgb) != width * height * 3:
        raise ValueError(f"rgb: must hold width*height*3 = {width * height * 3} bytes, "
                         f"got {len(rgb)}")

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    stride = width * 3
    raw = b"".join(b"\x00" + bytes(rgb[y * stride:(y + 1) * stride]) for y in range(height))
    png = (b"\x89PNG\r\n\x1a\n"
           + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    path = Path(path)
    path.write_bytes(png)
    return path


class Canvas:
    """An RGB pixel buffer with lines, rectangles and 5x7 text."""

    def __init__(self, width: int, height: int, background=WHITE):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i:i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color) -> None:
        for y in range(max(y0, 0), min(y1, self.height)):
            for x in range(max(x0, 0), min(x1, self.width)):
                self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color, thickness: int = 1) -> None:
        """Bresenham, drawn as a square brush of ``thickness`` pixels."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        half = thickness // 2
        while True:
            for ox in range(-half, thickness - half):
                for oy in range(-half, thickness - half):
                    self.set(x0 + ox, y0 + oy, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, color=BLACK, scale: int = 2) -> int:
        """Draw ``s`` (upper-cased) with its top-left at (x, y); returns the x after it."""
        for ch in s.upper():
            glyph = _FONT.get(ch, _FONT[" "])
            for gy, row in enumerate(glyph):
                for gx, cell in enumerate(row):
                    if cell == "#":
                        self.rect(x + gx * scale, y + gy * scale, x + (gx + 1) * scale,
                                  y + (gy + 1) * scale, color)
            x += 6 * scale
        return x

    def text_width(self, s: str, scale: int = 2) -> int:
        return len(s) * 6 * scale

    def save(self, path: str | Path) -> Path:
        return write_png(path, self.width, self.height, self.pixels)


def read_metrics(path: str | Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _series(rows: list[dict], key: str) -> list[tuple[float, float]]:
    return [(float(r["step"]), float(r[key])) for r in rows
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def _label(v: float, span: float) -> str:
    """``v`` with as many decimals as the axis span needs (0.25, 0.013, 1200)."""
    if abs(v) >= 1e5 or (span < 1e-4 and v != 0):
        return f"{v:.2e}"
    decimals = max(0, 1 - math.floor(math.log10(max(span / 4, 1e-12))))
    text = f"{v:.{min(decimals, 6)}f}"
    return "0" if float(text) == 0 else text


def _panel(c: Canvas, box: tuple[int, int, int, int], title: str,
           curves: list[tuple[str, list[tuple[float, float]], tuple]],
           unit_range: bool = False) -> None:
    """Axes, grid, labels, a legend on the title line, and the curves; ``unit_range``: the y
    axis is [0, 1] when every value lies in it (rewards, accuracies)."""
    x0, y0, x1, y1 = box
    c.text(x0, y0 - 26, title, BLACK)
    points = [p for _, pts, _ in curves for p in pts]
    c.rect(x0, y0, x1, y0 + 1, BLACK)
    c.rect(x0, y1, x1 + 1, y1 + 1, BLACK)
    c.rect(x0, y0, x0 + 1, y1, BLACK)
    c.rect(x1, y0, x1 + 1, y1, BLACK)
    if not points:
        c.text(x0 + 20, (y0 + y1) // 2, "NO DATA", GREY)
        return
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    xlo, xhi = min(xs), max(xs)
    ylo, yhi = min(ys), max(ys)
    if unit_range and 0.0 <= ylo and yhi <= 1.0:
        ylo, yhi = 0.0, 1.0
    else:
        if yhi - ylo < 1e-12:
            ylo, yhi = ylo - 0.5, yhi + 0.5
        pad = 0.05 * (yhi - ylo)
        ylo, yhi = ylo - pad, yhi + pad
    if xhi == xlo:
        xlo, xhi = xlo - 1, xhi + 1

    def px(x: float) -> int:
        return int(round(x0 + 4 + (x - xlo) / (xhi - xlo) * (x1 - x0 - 8)))

    def py(y: float) -> int:
        return int(round(y1 - 4 - (y - ylo) / (yhi - ylo) * (y1 - y0 - 8)))

    for i in range(5):  # grid and y labels
        v = ylo + (yhi - ylo) * i / 4
        yy = py(v)
        c.rect(x0 + 1, yy, x1, yy + 1, GREY)
        lab = _label(v, yhi - ylo)
        c.text(x0 - 8 - c.text_width(lab), yy - 7, lab)
    for v in sorted({round(xlo), round((xlo + xhi) / 2), round(xhi)}):  # integer steps
        lab = str(int(v))
        c.text(px(v) - c.text_width(lab) // 2, y1 + 8, lab)
    lx = x1
    for name, pts, color in reversed(curves):  # legend on the title line, right aligned
        if not pts:
            continue
        lx -= c.text_width(name) + 34
        c.rect(lx, y0 - 21, lx + 20, y0 - 17, color)
        c.text(lx + 26, y0 - 26, name, color)
    for _, pts, color in curves:
        pts = sorted(pts)
        if len(pts) == 1:
            c.rect(px(pts[0][0]) - 3, py(pts[0][1]) - 3, px(pts[0][0]) + 3, py(pts[0][1]) + 3,
                   color)
        for (xa, ya), (xb, yb) in zip(pts, pts[1:]):
            c.line(px(xa), py(ya), px(xb), py(yb), color, thickness=2)


_TOP = (("reward_mean", BLUE), ("accuracy", BLUE), ("reward_accuracy", BLUE),
        ("greedy_accuracy", GREEN), ("eval_accuracy", GREEN), ("eval_p_correct", PURPLE))
_BOTTOM = (("loss", ORANGE), ("eval_loss", RED), ("critic_loss", GREEN))


def _panels(rows: list[dict], phase: str):
    """(title, [(legend, points, color)]) per panel: rewards and accuracies (all in [0, 1]),
    then losses."""
    top = [(k, _series(rows, k), col) for k, col in _TOP if _series(rows, k)]
    bottom = [(k, _series(rows, k), col) for k, col in _BOTTOM if _series(rows, k)]
    title = {"sft": "HELD-OUT P(CORRECT)", "rw": "PAIR ACCURACY",
             "dpo": "PREFERENCE ACCURACY"}.get(phase, "REWARD")
    return [(f"{phase} {title}", top or [("reward_mean", [], BLUE)]),
            (f"{phase} LOSS", bottom or [("loss", [], ORANGE)])]


def plot_metrics(metrics_path: str | Path, png_path: str | Path, *, phase: str,
                 use_matplotlib: bool = True) -> Path:
    """Plot the ``phase`` rows of a metrics.jsonl file (reward and loss against step)."""
    rows = [r for r in read_metrics(metrics_path) if r.get("phase") == phase]
    panels = _panels(rows, phase)
    png_path = Path(png_path)
    if use_matplotlib:
        try:
            return _plot_matplotlib(panels, png_path)
        except ImportError:
            pass
    width, height = 900, 640
    c = Canvas(width, height)
    left, right = 120, width - 30
    _panel(c, (left, 50, right, 280), panels[0][0], panels[0][1], unit_range=True)
    _panel(c, (left, 360, right, 590), panels[1][0], panels[1][1])
    c.text(width // 2 - c.text_width("STEP") // 2, 616, "STEP")
    return c.save(png_path)


def _plot_matplotlib(panels, png_path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(9, 6.4), sharex=True)
    for ax, (title, curves) in zip(axes, panels):
        for name, pts, color in curves:
            if pts:
                ax.plot(*zip(*sorted(pts)), label=name, color=[c / 255 for c in color])
        ax.set_title(title.lower())
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
