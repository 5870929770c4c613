"""The adaptation report as one self-contained HTML page: every plot is an inline SVG drawn by matplotlib (text as
paths, so not even a font is fetched), tables are plain HTML, and nothing on the page loads anything (its icon is an
empty data: URI, or browsers would ask the server for /favicon.ico)."""

from __future__ import annotations

import html
import io
import json

from moetune.api.report import AdaptationReport

_STYLE = """body{font-family:sans-serif;margin:2em;max-width:70em}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:.2em .6em;text-align:left}.bad{color:#b00;font-weight:bold}
figure.plot{margin:1em 0}pre{background:#f4f4f4;padding:1em;overflow:auto}"""


def _svg(figure) -> str:
    import matplotlib.pyplot as plt

    out = io.StringIO()
    figure.savefig(out, format="svg", bbox_inches="tight")
    plt.close(figure)
    text = out.getvalue()
    return text[text.index("<svg"):]  # without the XML prolog and DOCTYPE (an external DTD reference)


def _figure(plot_id: str, caption: str, draw) -> str:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": plot_id}):
        figure, axes = plt.subplots(figsize=(8, 3.2))
        draw(axes)
        return (f'<figure class="plot" id="{plot_id}">{_svg(figure)}'
                f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _loss_plot(report: AdaptationReport):
    def draw(ax):
        steps = [s.step for s in report.steps]
        ax.plot(steps, [s.train_loss for s in report.steps], label="train loss")
        valid = [(s.step, s.valid_loss) for s in report.steps if s.valid_loss is not None]
        if valid:
            ax.plot(*zip(*valid), "o-", label="valid loss")
        for c in report.checkpoints:
            ax.axvline(c.step, color="grey", linestyle=":", linewidth=1)
        for step in report.resumes:
            ax.axvline(step, color="red", linestyle="--", linewidth=1)
        ax.set_xlabel("step")
        ax.legend()
    return _figure("plot-loss", "Loss per step (dotted: checkpoints, dashed: resumed from)", draw)


def _throughput_plot(report: AdaptationReport):
    def draw(ax):
        steps = [s.step for s in report.steps]
        train = [s.train_seconds or 0.0 for s in report.steps]
        alltoall = [(s.alltoall_share or 0.0) * t for s, t in zip(report.steps, train)]
        ax.bar(steps, [t - a for t, a in zip(train, alltoall)], label="compute")
        ax.bar(steps, alltoall, bottom=[t - a for t, a in zip(train, alltoall)], label="all-to-all")
        ax.bar(steps, [s.eval_seconds or 0.0 for s in report.steps], bottom=train, label="evaluation")
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        twin = ax.twinx()
        twin.plot(steps, [s.tokens_per_second for s in report.steps], color="black", label="tokens/s")
        twin.set_ylabel("tokens/s")
        ax.legend(loc="upper left")
    return _figure("plot-throughput", "Step time split and tokens per second", draw)


def _memory_plot(report: AdaptationReport):
    def draw(ax):
        peaks = report.memory.peak_mb_per_rank
        ax.bar([f"rank {r}" for r in range(len(peaks))], peaks, label="peak")
        if report.memory.budget_mb:
            ax.axhline(report.memory.budget_mb, color="red", linestyle="--", label="budget")
        ax.set_ylabel("MB")
        ax.legend()
    return _figure("plot-memory", "Peak memory per rank against its budget", draw)


def _imbalance_plot(report: AdaptationReport):
    load = report.expert_imbalance

    def draw(ax):
        image = ax.imshow(load.ratio, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_yticks(range(len(load.layers)), [f"layer {layer}" for layer in load.layers])
        ax.set_xticks(range(len(load.steps)), [str(s) for s in load.steps])
        ax.set_xlabel("step")
        ax.figure.colorbar(image, ax=ax, label="max / mean expert load")
    return _figure("plot-expert-load", "Expert-load imbalance per MoE layer over time", draw)


def _evaluation_plot(report: AdaptationReport):
    evaluation = report.evaluation

    def draw(ax):
        for metric in evaluation.metrics:
            steps, scores = list(evaluation.steps), list(evaluation.scores[metric])
            if evaluation.base:
                steps, scores = [0, *steps], [evaluation.base[metric], *scores]
            ax.plot(steps, scores, "o-", label=metric)
        if report.selected_step is not None:
            ax.axvline(report.selected_step, color="green", linestyle="--", linewidth=1, label="exported")
        ax.set_xlabel("step")
        ax.set_ylim(-0.05, 1.05)
        ax.legend()
    return _figure("plot-evaluation", "Evaluation scores per evaluated step (step 0: the base model; dashed: the "
                                      "exported checkpoint)", draw)


def _table(rows: list[dict], bad_key: str | None = None) -> str:
    if not rows:
        return "<p>none</p>"
    columns = list(dict.fromkeys(k for row in rows for k in row))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)

    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return html.escape(", ".join(map(str, value)) if isinstance(value, list) else str(value))

    body = "".join(
        f'<tr{" class=bad" if bad_key and not row.get(bad_key) else ""}>'
        + "".join(f"<td>{cell(row.get(c, ''))}</td>" for c in columns) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_page(report: AdaptationReport) -> str:
    plots = [_loss_plot(report), _throughput_plot(report), _memory_plot(report)]
    if report.expert_imbalance:
        plots.append(_imbalance_plot(report))
    if report.evaluation and report.evaluation.steps:
        plots.append(_evaluation_plot(report))
    alignment = ("<p>not checked (alignment_check off, or the run resumed)</p>" if report.alignment is None else
                 _table([r.model_dump(exclude_none=True) for r in report.alignment], bad_key="ok"))
    t = report.throughput
    figures = (f"<p>{t.tokens_per_second:,.1f} tokens/s, {t.step_seconds:.3g} s per step, evaluation "
               f"{t.eval_share:.1%} of step time, all-to-all {t.alltoall_share:.1%} of training time"
               + (f", context-parallel exchanges {t.context_share:.1%}" if t.context_share is not None else "")
               + (", pipeline stages idle (bubble, sends, receives) "
                  + " / ".join(f"{share:.1%}" for share in t.pipeline_idle_share) + " of training time, sending "
                  + " / ".join(f"{mb:,.1f}" for mb in t.pipeline_sent_mb) + " MB a step"
                  if t.pipeline_idle_share is not None else "")
               + f"; loss {report.first_train_loss:.4f} → {report.last_train_loss:.4f}"
               + (f", valid {report.last_valid_loss:.4f}" if report.last_valid_loss is not None else "") + "</p>")
    reproduce = json.dumps(report.reproduce.job, indent=2)
    sections = [
        f"<h1>Adaptation report: {html.escape(report.job_id)}</h1><p>model {html.escape(report.model)}</p>",
        "<h2>Versions</h2>" + _table([report.versions]),
        "<h2>Precision alignment</h2>" + alignment,
        "<h2>Training</h2>" + figures + "".join(plots),
        "<h2>Checkpoints</h2>" + _table([c.model_dump() for c in report.checkpoints])
        + (f"<p>resumed from steps {', '.join(map(str, report.resumes))}</p>" if report.resumes else ""),
        "<h2>LoRA coverage</h2>" + _table(report.lora_coverage),
        f'<h2>Reproduce</h2><p>POST this body to /v1/fine_tuning/jobs (seed {report.reproduce.seed}):</p>'
        f'<pre id="reproduce">{html.escape(reproduce)}</pre>',
    ]
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><link rel="icon" href="data:,"><title>{html.escape(report.job_id)} adaptation '
            f"report</title><style>{_STYLE}</style></head><body>{''.join(sections)}</body></html>")
