#!/usr/bin/python3
"""Runs every query of a Grafana dashboard against a live Prometheus, and can draw its panels.

  check_dashboard.py --prometheus URL [--rate_interval 30s] [--may_be_empty TITLE,...]
                     [--png OUT --range_s N] DASHBOARD_JSON

Each panel target's `expr` (with $release -> the variable's "All" value and $__rate_interval ->
--rate_interval) is sent to URL's /api/v1/query: the query must be valid PromQL for this
Prometheus and, unless its panel is named in --may_be_empty, return data. The release variable's
query (label_values) must return a value too. With --png, every time-series panel is drawn from
/api/v1/query_range over the last N seconds into one PNG (matplotlib, python3-matplotlib).
Exits 1 naming each failing query. Standard library only, apart from --png.
"""
import argparse
import json
import re
import sys
import time
import urllib.parse
import urllib.request


def api(base, path, **params):
    url = "%s/api/v1/%s?%s" % (base.rstrip("/"), path, urllib.parse.urlencode(params, doseq=True))
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:  # Prometheus answers bad queries with 400 and a JSON body
        return json.load(e)


def panels_of(dash):
    for p in dash["panels"]:
        if p.get("type") == "row":
            yield from p.get("panels", [])
        else:
            yield p


def expand(expr, variables, rate_interval):
    expr = expr.replace("$__rate_interval", rate_interval)
    for name, value in variables.items():
        expr = expr.replace("${%s}" % name, value).replace("$" + name, value)
    left = re.findall(r"\$\{?[A-Za-z_]\w*", expr)
    if left:
        raise ValueError("unknown variable %s" % left[0])
    return expr


def legend(fmt, metric):
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt) or str(metric)


def draw(base, dash, variables, rate_interval, out, range_s):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    series = [p for p in panels_of(dash) if p["type"] == "timeseries"]
    cols = 3
    rows = (len(series) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False)
    end = time.time()
    scale = {"s": (1e3, "ms"), "percentunit": (100.0, "%"), "Bps": (1e-6, "MB/s"), "reqps": (1.0, "steps/s")}
    for ax, p in zip(axes.flat, series):
        factor, unit = scale.get(p["fieldConfig"]["defaults"].get("unit"), (1.0, ""))
        for t in p["targets"]:
            r = api(base, "query_range", query=expand(t["expr"], variables, rate_interval), start=end - range_s, end=end,
                    step=1)
            for s in r.get("data", {}).get("result", []):
                xs = [float(v[0]) - end for v in s["values"]]
                ys = [float(v[1]) * factor for v in s["values"]]
                ax.plot(xs, ys, label=legend(t.get("legendFormat", ""), s["metric"])[:40], linewidth=1.2)
        ax.set_title(p["title"], fontsize=10)
        ax.set_ylabel(unit, fontsize=8)
        ax.set_xlabel("seconds before the scrape", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6, loc="upper left", ncol=2)
    for ax in list(axes.flat)[len(series):]:
        ax.axis("off")
    fig.suptitle("%s: panels drawn from a live Prometheus (%s)" % (dash["title"], time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                                time.gmtime(end))))
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(out, dpi=90)
    print("wrote %s (%d panels)" % (out, len(series)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prometheus", required=True)
    ap.add_argument("--rate_interval", default="30s")
    ap.add_argument("--may_be_empty", default="")
    ap.add_argument("--png", default="")
    ap.add_argument("--range_s", type=int, default=120)
    ap.add_argument("dashboard")
    a = ap.parse_args()
    dash = json.load(open(a.dashboard))
    may_be_empty = {t for t in a.may_be_empty.split(",") if t}
    variables, failures, n = {}, [], 0
    for v in dash.get("templating", {}).get("list", []):
        if v["type"] == "datasource":
            continue
        variables[v["name"]] = v.get("allValue", ".*")
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", q)
        if not m:
            failures.append("variable %s: query %r is not label_values(metric, label)" % (v["name"], q))
            continue
        r = api(a.prometheus, "label/%s/values" % m.group(2), **{"match[]": m.group(1)})
        if r.get("status") != "success" or not r.get("data"):
            failures.append("variable %s: %s returned no values" % (v["name"], q))
    titles = set()
    for p in panels_of(dash):
        titles.add(p["title"])
        for t in p.get("targets", []):
            n += 1
            try:
                expr = expand(t["expr"], variables, a.rate_interval)
            except ValueError as e:
                failures.append("%s: %s" % (p["title"], e))
                continue
            r = api(a.prometheus, "query", query=expr)
            if r.get("status") != "success":
                failures.append("%s: %s: %s" % (p["title"], r.get("error", r), expr))
            elif not r["data"]["result"] and p["title"] not in may_be_empty:
                failures.append("%s: no data: %s" % (p["title"], expr))
    for t in may_be_empty - titles:
        failures.append("--may_be_empty names %r, no such panel" % t)
    for f in failures:
        print("FAIL " + f)
    if not failures:
        print("ok   %d queries of %d panels valid, %d returned data (allowed empty: %s)" %
              (n, len(titles), n, ", ".join(sorted(may_be_empty)) or "none") if not may_be_empty else
              "ok   %d queries of %d panels valid; all but those of %s returned data" % (n, len(titles),
                                                                                        ", ".join(sorted(may_be_empty))))
    if a.png:
        draw(a.prometheus, dash, variables, a.rate_interval, a.png, a.range_s)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
