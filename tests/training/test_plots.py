"""The figures' compact PNG writer: a palette image that keeps a plot's colours."""

from __future__ import annotations

import io

from PIL import Image

from dspark_serve.training.plots import save_png


class _Figure:
    """Stands in for a matplotlib figure: savefig writes an RGBA PNG like matplotlib's, a white
    canvas with two coloured lines and an anti-aliased (grey ramp) edge."""

    def __init__(self) -> None:
        im = Image.new("RGBA", (300, 120), (255, 255, 255, 255))
        px = im.load()
        for x in range(300):
            px[x, 30] = (31, 119, 180, 255)  # matplotlib's first two cycle colours
            px[x, 60] = (255, 127, 14, 255)
        for x in range(256):
            px[x, 90] = (x, x, x, 255)
        self.image = im
        self.dpi: int | None = None

    def savefig(self, buf: io.BytesIO, format: str, dpi: int) -> None:
        assert format == "png"
        self.dpi = dpi
        self.image.save(buf, format="PNG")


def test_save_png_writes_a_palette_image_that_keeps_the_plots_colours(tmp_path):
    fig = _Figure()
    path = tmp_path / "plot.png"
    save_png(fig, path, dpi=77)
    assert fig.dpi == 77
    with Image.open(path) as im:
        assert im.mode == "P"  # 256 colours at most, not true colour
        assert len(im.getcolors(256) or []) <= 256
        got = im.convert("RGB")
        want = fig.image.convert("RGB")
        assert got.size == want.size
        for y in (0, 30, 60):  # background and the two lines exactly
            for x in (0, 150, 299):
                assert got.getpixel((x, y)) == want.getpixel((x, y))
        # the grey ramp within a few levels (the palette's colours are chosen, not fixed)
        err = max(abs(got.getpixel((x, 90))[0] - x) for x in range(256))
        assert err <= 8
