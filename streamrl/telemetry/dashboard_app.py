"""The scheduler side of the streamrl page: a Bokeh app served by the scheduler's own dashboard.

Everything here runs in the scheduler's process, on its event loop: :func:`attach` adds the page
to the dashboard's HTTP server (``http://HOST:8787/streamrl`` next to ``/status``), and each
browser session of the page reads the step summaries the run logs as scheduler events under
:data:`TOPIC` (``streamrl.telemetry.dashboard.publish``), once a second.

Distributed serves its own pages as one ``BokehTornado`` application inside the scheduler's
``RoutingApplication`` (``distributed.dashboard.scheduler.connect``). That routing application
asks each of its applications in turn for a handler at request time, so another Bokeh
application can be added to a running scheduler the same way: built by
``distributed.dashboard.core.BokehApplication`` (Dask's websocket origins and session settings),
then ``add_application``, ``initialize`` and ``start``. The scheduler stops it with its own
applications when it closes.

Bokeh and Dask's dashboard modules are imported inside the functions: the client process
imports this module only to send :func:`attach` by reference.

:func:`attach` also makes the whole dashboard (Dask's pages too) answer only requests whose
``Host`` header names the server itself, and no page of another site (``dashboard_guard.py``).
"""

from __future__ import annotations

import html
import logging
import math
import re
import time

from streamrl.telemetry.dashboard_guard import guard_host

#: Scheduler event topic the run's step summaries are logged under.
TOPIC = "streamrl"
#: The page's path under the dashboard's prefix.
PATH = "streamrl"

logger = logging.getLogger(__name__)


def attach(dask_scheduler) -> dict | None:
    """Add the streamrl page to ``dask_scheduler``'s dashboard, once; call it on the scheduler's
    event loop (``client.run_on_scheduler(attach)``, or a preload's ``dask_setup``).

    Returns ``{"path": "/streamrl", "port": 8787}`` (the path under the dashboard's prefix and the
    dashboard's port), or None when the scheduler serves no dashboard pages: started with
    ``dashboard=False`` (its HTTP server then has only health and metrics routes) or without a
    usable Bokeh.
    """
    scheduler = dask_scheduler
    routing = getattr(scheduler, "http_application", None)
    server = getattr(scheduler, "http_server", None)
    if routing is None or server is None:
        return None
    guard_host(routing, server, scheduler)
    prefix = None
    for app in routing.applications:
        ours = getattr(app, "streamrl_page", None)
        if ours is not None:  # already attached (a preload, or an earlier run on this scheduler)
            return ours
        if "/status" in getattr(app, "app_paths", ()):  # Dask's own pages: share their prefix
            prefix = app.prefix  # "" or "/some/prefix" (BokehTornado strips the slashes)
    if prefix is None:  # no Dask pages: the dashboard is off, and stays off
        return None
    from distributed.dashboard.core import BokehApplication
    from tornado.ioloop import IOLoop

    variables = _template_variables(scheduler)
    app = BokehApplication({"/" + PATH: page_doc}, scheduler, prefix=prefix, template_variables=variables)
    info = {"path": f"{prefix}/{PATH}", "port": server.port}
    app.streamrl_page = info
    routing.add_application(app)
    app.initialize(IOLoop.current())
    app.start()
    return info


def _template_variables(scheduler) -> dict:
    """The variables Dask renders its pages' navigation bar with, ``streamrl`` among its pages.

    Dask's pages share one list of page names (memoized per scheduler), so adding the page there
    also gives every Dask page a link to it; without Dask's list (an older layout) the page gets
    a bar of its own.
    """
    try:
        from distributed.dashboard.scheduler import template_variables

        variables = template_variables(scheduler)
        if PATH not in variables["pages"]:
            variables["pages"].append(PATH)
        return variables
    except Exception:  # a navigation link is a nicety; the page works without Dask's bar
        return {"pages": ["status", "workers", "tasks", "system", PATH], "plots": [], "jupyter": False}


def page_doc(scheduler, extra: dict, doc) -> None:
    """Bokeh document function of the page (one call per browser session)."""
    from distributed.dashboard.components import add_periodic_callback
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    page = StreamrlPage(scheduler)
    page.update()
    add_periodic_callback(doc, page, 1000)
    doc.title = "streamrl"
    doc.add_root(page.root)
    doc.template = env.get_template("simple.html")  # Dask's navigation bar and styles
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


#: per-step columns of the figures' source, from a summary (``dashboard.summarize``)
STEP_COLUMNS = ("step", "reward", "samples_per_s", "tokens_per_s", "staleness", "version", "token_staleness", "ess")
#: evaluation columns: the eval reward (the training reward's scale) and pass@1
EVAL_COLUMNS = ("step", "eval_reward", "eval_pass1")


def _num(value) -> float:
    """A float for a plot: NaN for anything missing or not a number (Bokeh leaves a gap)."""
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):  # (OverflowError: an int past a float's, 10**400)
        return math.nan


#: the most pools (``busy``) and evaluation figures (``eval``) a summary may carry: each pool is
#: a line of the busy figure, so a message naming thousands would bury the page
MAX_SUMMARY_ENTRIES = 64
#: the most pools the page draws, over every message it reads (each is a line, a column and a
#: tooltip row in every browser session)
MAX_POOLS = 32
#: what a pool's name may hold: it becomes a column name inside a Bokeh tooltip template, which
#: reads what is not a placeholder as HTML
POOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: the most characters of the run's name or mode the header shows
MAX_HEADER_TEXT = 120


def _int_or_none(value) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def _numbers(value, texts: tuple[str, ...] = ()) -> bool:
    """Whether ``value`` is a table of at most :data:`MAX_SUMMARY_ENTRIES` names (str) to numbers
    (not bools; NaN is a summary's "unknown", a gap in the figure), those named in ``texts`` a str."""
    if not isinstance(value, dict) or len(value) > MAX_SUMMARY_ENTRIES:
        return False
    return all(isinstance(k, str) and (isinstance(v, str) if k in texts else
                                       isinstance(v, (int, float)) and not isinstance(v, bool))
               for k, v in value.items())


def valid(msg) -> bool:
    """A step summary this page can show (the topic is public: anyone may log to it): the shape
    ``dashboard.summarize`` gives, at least where the page reads it without :func:`_num` --
    ``step`` an int, a ``run``; ``version``, ``staleness`` and ``steps`` ints or absent;
    ``busy`` and ``eval`` tables of numbers (``eval``'s ``error`` a str) or absent. Anything
    else is skipped: one bad message must not make every update fail."""
    step = msg.get("step") if isinstance(msg, dict) else None
    # (a step the browser's numbers hold exactly: a JavaScript number is a double)
    if not (isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 2**53 and "run" in msg):
        return False
    if not all(_int_or_none(msg.get(key)) for key in ("version", "staleness", "steps")):
        return False
    if not all(msg.get(key) is None or _numbers(msg[key], texts) for key, texts in (("busy", ()), ("eval", ("error",)))):
        return False
    return all(POOL_NAME.fullmatch(pool) for pool in msg.get("busy") or {})


class StreamrlPage:
    """The page's figures and the state of one browser session: the run it shows (the newest
    run that logged to :data:`TOPIC`), its summaries by step, and the newest event read.

    :meth:`update` reads only the events newer than the last one read and streams steps that
    come in order to the browser; a run that starts again on the same scheduler, or a step seen
    twice (a resumed run), redraws the lot.
    """

    def __init__(self, scheduler):
        from bokeh.layouts import column, gridplot
        from bokeh.models import (ColumnDataSource, Div, HoverTool, Legend, NumeralTickFormatter,
                                  Range1d)
        from bokeh.plotting import figure

        self.scheduler = scheduler
        self.run = None
        self.rows: dict[int, dict] = {}
        self.last_step = -1
        self.seen = -math.inf  # scheduler time of the newest event read
        self.updated = None  # ... and of the newest step shown
        self.last_eval: tuple[int, dict] | None = None  # (step, its eval summary)
        self.pools: list[str] = []
        self.steps = ColumnDataSource({c: [] for c in STEP_COLUMNS})
        self.evals = ColumnDataSource({c: [] for c in EVAL_COLUMNS})
        self.header = Div(text=self._header_html(), sizing_mode="stretch_width")

        def fig(title, y_label):
            f = figure(title=title, height=300, sizing_mode="stretch_width", x_axis_label="step",
                       y_axis_label=y_label, tools="pan,wheel_zoom,box_zoom,reset,save",
                       toolbar_location="above")
            f.toolbar.logo = None
            # the legend in one line above the plot: inside it would cover the newest steps; every
            # figure has one, so the plots of a row line up
            f.add_layout(Legend(orientation="horizontal", location="top_left", click_policy="hide",
                                border_line_alpha=0, background_fill_alpha=0, margin=0), "above")
            return f

        self.reward = fig("Reward", "reward")
        self.reward.line("step", "reward", source=self.steps, line_width=2, legend_label="train reward")
        self.eval_shown = False  # eval lines come with the first evaluation (most runs have none)
        self.reward.add_tools(HoverTool(tooltips=[("step", "@step"), ("reward", "@reward{0.000}"),
                                                  ("version", "v@version")], mode="vline",
                                        renderers=[self.reward.renderers[0]]))

        self.speed = fig("Throughput", "samples/s")
        self.speed.line("step", "samples_per_s", source=self.steps, line_width=2, color="#9467bd",
                        legend_label="samples/s (trained samples / step time)")
        self.speed.add_tools(HoverTool(tooltips=[("step", "@step"), ("samples/s", "@samples_per_s{0.0}"),
                                                 ("tokens/s", "@tokens_per_s{0.0}")], mode="vline"))

        self.staleness = fig("Staleness (max policy versions behind)", "versions")
        self.staleness.step("step", "staleness", source=self.steps, mode="center", line_width=2,
                            color="#ff7f0e", legend_label="oldest sample trained")
        # how stale the tokens were on average, and (in the hover) how evenly their importance
        # weights spread: the effective sample size under 0.5 is what the console warns about
        self.staleness.line("step", "token_staleness", source=self.steps, line_width=2, color="#2ca02c",
                            legend_label="mean token staleness")
        self.staleness.y_range.start = 0
        self.staleness.yaxis.ticker.min_interval = 1  # whole versions
        self.staleness.add_tools(HoverTool(tooltips=[("step", "@step"), ("staleness", "@staleness"),
                                                     ("mean token staleness", "@token_staleness{0.00}"),
                                                     ("importance ESS", "@ess{0.00}")], mode="vline",
                                           renderers=[self.staleness.renderers[0]]))

        self.busy = fig("Pool busy share", "busy")
        self.busy.y_range = Range1d(0, 1.05)
        self.busy.yaxis.formatter = NumeralTickFormatter(format="0%")
        self.busy_hover = HoverTool(tooltips=[("step", "@step")], mode="vline")
        self.busy.add_tools(self.busy_hover)

        grid = gridplot([[self.reward, self.speed], [self.busy, self.staleness]],
                        sizing_mode="stretch_width", merge_tools=False)
        self.root = column(self.header, grid, sizing_mode="stretch_width")

    # -- reading the events ---------------------------------------------------------------
    def _fresh(self) -> list[tuple[float, dict]]:
        """Events newer than the last one read (the one read last again: it is skipped below
        when unchanged), oldest first."""
        out = []
        for t, msg in reversed(self.scheduler.get_events(TOPIC)):
            if t < self.seen:
                break
            out.append((t, msg))
        out.reverse()
        return out

    def update(self) -> None:
        """Periodic callback: take in new summaries, update the figures and the header."""
        try:
            self._update()
        except Exception:  # one bad message must not stop the page's updates for good
            logger.warning("streamrl page: update failed", exc_info=True)

    def _update(self) -> None:
        fresh = self._fresh()
        redraw, added = False, []
        for t, msg in fresh:
            self.seen = t
            if not valid(msg):
                continue
            if msg["run"] != self.run:  # a new run on this scheduler: show it from scratch
                self.run, self.rows, self.last_step, self.last_eval = msg["run"], {}, -1, None
                redraw, added = True, []
            step = msg["step"]
            if self.rows.get(step) == msg:
                continue
            if step <= self.last_step:
                redraw = True  # (the redraw also finds the newest evaluation again)
            self.rows[step] = msg
            if msg.get("eval") and (self.last_eval is None or step >= self.last_eval[0]):
                self.last_eval = (step, msg["eval"])
            self.last_step = max(self.last_step, step)
            self.updated = t
            added.append(msg)
        if not self.eval_shown and self._eval_columns(added)["step"]:
            self._add_evals()
        pools = [p for m in added for p in m.get("busy") or {} if p not in self.pools]
        pools = list(dict.fromkeys(pools))[:max(0, MAX_POOLS - len(self.pools))]  # (the rest are not drawn)
        if pools:
            for p in pools:
                self._add_pool(p)
            redraw = True
        if redraw:
            rows = [self.rows[s] for s in sorted(self.rows)]
            evals = [(m["step"], m["eval"]) for m in rows if m.get("eval")]
            self.last_eval = evals[-1] if evals else None
            self.steps.data = self._step_columns(rows)
            self.evals.data = self._eval_columns(rows)
        elif added:
            self.steps.stream(self._step_columns(added))
            evals = self._eval_columns(added)
            if evals["step"]:
                self.evals.stream(evals)
        self.header.text = self._header_html()

    def _add_evals(self) -> None:
        self.eval_shown = True
        f, src = self.reward, self.evals
        f.line("step", "eval_reward", source=src, color="#d62728", line_dash="dashed", legend_label="eval reward")
        f.scatter("step", "eval_reward", source=src, color="#d62728", size=7, legend_label="eval reward")
        f.line("step", "eval_pass1", source=src, color="#2ca02c", line_dash="dotted", legend_label="eval pass@1")
        f.scatter("step", "eval_pass1", source=src, color="#2ca02c", size=6, marker="square",
                  legend_label="eval pass@1")

    def _add_pool(self, pool: str) -> None:
        from bokeh.palettes import Category10

        colors = Category10[10]
        color = colors[len(self.pools) % len(colors)]
        column = "busy_" + pool
        self.pools.append(pool)
        # every row needs the new column before a renderer reads it
        self.steps.data = {**self.steps.data, column: [math.nan] * len(self.steps.data["step"])}
        self.busy.line("step", column, source=self.steps, line_width=2, color=color, legend_label=pool)
        self.busy_hover.tooltips = [*self.busy_hover.tooltips, (pool, "@{%s}{0%%}" % column)]

    def _step_columns(self, rows: list[dict]) -> dict[str, list]:
        out = {c: [] for c in STEP_COLUMNS} | {"busy_" + p: [] for p in self.pools}
        for m in rows:
            out["step"].append(m["step"])
            for c in STEP_COLUMNS[1:]:
                out[c].append(_num(m.get(c)))
            busy = m.get("busy") or {}
            for p in self.pools:
                out["busy_" + p].append(_num(busy.get(p)))
        return out

    @staticmethod
    def _eval_columns(rows: list[dict]) -> dict[str, list]:
        out = {c: [] for c in EVAL_COLUMNS}
        for m in rows:
            ev = m.get("eval")
            if ev and ("reward_mean" in ev or "pass@1" in ev):
                out["step"].append(m["step"])
                out["eval_reward"].append(_num(ev.get("reward_mean")))
                out["eval_pass1"].append(_num(ev.get("pass@1")))
        return out

    def _header_html(self) -> str:
        """One line: the run, where it is, its latest numbers, and how fresh they are."""
        if not self.rows:
            return ("<div style='font-size:15px;padding:4px 0'><b>streamrl</b> &middot; "
                    "waiting for the first step of a run on this scheduler&hellip;</div>")
        last = self.rows[self.last_step]

        def esc(value) -> str:  # every field as text in the page's HTML, a name cut to a header's length
            return html.escape(str(value)[:MAX_HEADER_TEXT])

        parts = ["<b>streamrl</b>"]
        if last.get("name"):
            parts.append(f"<b>{esc(last['name'])}</b>")
        if last.get("mode"):
            parts.append(f"mode {esc(last['mode'])}")
        total = last.get("steps") if _int_or_none(last.get("steps")) else None  # (a count, or none known)
        done = self.last_step + 1
        # a count, as the console's "step 51/60" is; the figures' x axis is metrics.jsonl's step index
        parts.append(f"{done}/{esc(total)} steps" if total else f"{done} step" + "s" * (done != 1))
        parts.append(f"policy v{esc(last.get('version'))}")
        parts.append(f"reward {_num(last.get('reward')):.3f}")
        parts.append(f"{_num(last.get('samples_per_s')):.1f} samples/s")
        parts.append(f"staleness {esc(last.get('staleness'))}")
        if self.last_eval:
            at, ev = self.last_eval
            if "pass@1" in ev:
                parts.append(f"eval pass@1 {_num(ev['pass@1']):.3f} at step {at}")
            elif "error" in ev:
                parts.append(f"eval failed at step {at}")
        if total and done >= total:
            state = "finished"
        else:
            age = time.time() - self.updated if self.updated is not None else math.nan
            state = f"updated {age:.0f} s ago" if age == age else ""
        parts.append(f"<span style='color:#777'>{state}</span>")
        return ("<div style='font-size:15px;padding:4px 0'>" + " &middot; ".join(parts) + "</div>")
