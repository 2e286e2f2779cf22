"""The report: figures and one HTML page that explain the layer choice (``elsi report``).

``build_report(run_dirs, out)`` writes, per run, the activation wave (entropy across depth),
pair entropy and gains, the CKA map with its transition boundaries, the transition score,
the ELSI beam tree, ``selection.md`` and a self-contained ``index.html``; with several runs
the page puts the models side by side on a normalised depth axis.
"""

from elsi.report.build import baseline_layers, build_report, default_out, load_run
from elsi.report.figures import DPI, SIZES, pixel_size
from elsi.report.page import fmt

__all__ = ["DPI", "SIZES", "baseline_layers", "build_report", "default_out", "fmt", "load_run", "pixel_size"]
