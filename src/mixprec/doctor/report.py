"""The doctor's report: the probes' findings (:class:`~mixprec.probes.report.Findings`) rendered as report.txt,
doctor.json and PNG plots."""

from __future__ import annotations

import dataclasses
import os

from ..jsonio import write_json, write_text
from ..probes import plots
from ..probes.report import Findings

__all__ = ["DoctorReport"]


@dataclasses.dataclass
class DoctorReport(Findings):
    """Everything one doctor run found. ``render()`` for people, ``to_dict()`` for tools."""

    def render(self) -> str:
        t = self.title
        lines = [f"mixprec doctor: {t.get('recipe')} [{t.get('impl')}] on {t.get('model', '?')}"
                 f" / {t.get('data', '?')}, {t.get('steps')} steps"
                 + (f" of batch {t['batch_size']}" if t.get("batch_size") else "")
                 + f", {t.get('params', 0):,} params, {t.get('device')}",
                 f"  {t.get('describe', '')}", ""]
        sections = [self.render_map(), self.render_ranges(), self.render_nonfinite(), self.render_lost(),
                    self.render_history()] + ([self.render_blocks()] if self.block_formats is not None else [])
        for section in sections:
            lines += section + [""]
        return "\n".join(lines + self.render_recommendations())

    def write(self, out_dir: str, *, plots: bool = True, written: list[str] | None = None) -> list[str]:
        """Write doctor.json, report.txt and (with matplotlib) the PNG plots; returns the paths.

        Every file is written atomically (:mod:`mixprec.jsonio`): a failed write raises
        :class:`~mixprec.errors.OutputError` naming the file, and ``written`` (if given) holds the files written
        before it, intact. doctor.json is strict JSON (non-finite numbers are null).
        """
        written = [] if written is None else written
        path = os.path.join(out_dir, "doctor.json")
        write_json(path, self.to_dict(), indent=1)
        written.append(path)
        path = os.path.join(out_dir, "report.txt")
        write_text(path, self.render() + "\n")
        written.append(path)
        if plots:
            self._write_plots(out_dir, written)
        return list(written)

    def _write_plots(self, out_dir: str, written: list[str]) -> None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return
        head = f"{self.title.get('recipe')} on {self.title.get('model')}"
        draws = [
            *plots.range_heatmaps(self, out_dir, head),
            lambda: plots.loss_scale_plot(os.path.join(out_dir, "loss_scale.png"), self, head),
            lambda: plots.lost_updates_plot(os.path.join(out_dir, "lost_updates.png"), self, head),
            lambda: plots.block_formats_plot(os.path.join(out_dir, "block_formats.png"), self, head),
        ]
        for draw in draws:
            path = draw()
            if path:
                written.append(path)
