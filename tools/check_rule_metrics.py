#!/usr/bin/python3
"""Checks that every metric a rules file (or a Grafana dashboard) reads exists in live scrapes.

  check_rule_metrics.py [--rules RULES] RULES_OR_DASHBOARD SCRAPE [SCRAPE...]

RULES_OR_DASHBOARD: a Prometheus rules file (YAML: every rule's `expr`) or a Grafana dashboard
(JSON: every target's `expr`). SCRAPE: text-format scrapes of the processes (moe-rankd,
moe-controller). Names with a colon are recording rules, checked against the `record` names of
the rules file (the input itself, or --rules for a dashboard); `up` and `ALERTS` are Prometheus'
own. A histogram's _bucket / _sum /
_count series count as its family. Exits 1 naming each missing metric.
"""
import json
import re
import sys

KEYWORDS = {"sum", "avg", "max", "min", "count", "rate", "increase", "irate", "by", "without", "on", "ignoring",
            "group_left", "group_right", "histogram_quantile", "and", "or", "unless", "bool", "offset", "topk",
            "bottomk", "le", "abs", "clamp_min", "clamp_max", "delta", "deriv", "time", "vector", "scalar",
            "label_replace", "sort", "sort_desc", "absent", "changes", "resets", "quantile", "stddev"}


def exprs_of(path):
    text = open(path).read()
    if path.endswith(".json"):
        out = []

        def walk(node):
            if isinstance(node, dict):
                if isinstance(node.get("expr"), str):
                    out.append(node["expr"])
                for v in node.values():
                    walk(v)
            elif isinstance(node, list):
                for v in node:
                    walk(v)

        walk(json.loads(text))
        return out, set()
    import yaml  # python3-yaml (Debian)
    doc = yaml.safe_load(text)
    exprs, records = [], set()
    for group in doc.get("groups", []):
        for rule in group.get("rules", []):
            exprs.append(str(rule["expr"]))
            if "record" in rule:
                records.add(rule["record"])
    return exprs, records


def metric_names(expr):
    # Label matchers and strings are not metric names.
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "{}", expr)
    expr = re.sub(r"\[[^\]]*\]", "[]", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        word = m.group(0)
        rest = expr[m.end():].lstrip()
        if word in KEYWORDS or rest.startswith("("):
            continue
        if re.fullmatch(r"[0-9.e]+", word):
            continue
        names.add(word)
    return names


def scraped(paths):
    families, samples = {}, set()
    for p in paths:
        for line in open(p):
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split()[:4]
                families[name] = kind
            elif line and not line.startswith("#"):
                samples.add(re.split(r"[{ ]", line, 1)[0])
    return families, samples


def main(argv):
    extra_records = set()
    if len(argv) > 2 and argv[1] == "--rules":
        extra_records = exprs_of(argv[2])[1]
        argv = argv[:1] + argv[3:]
    if len(argv) < 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    exprs, records = exprs_of(argv[1])
    records |= extra_records
    families, samples = scraped(argv[2:])
    missing = []
    wanted = set()
    for e in exprs:
        wanted |= metric_names(e)
    for name in sorted(wanted):
        if name in ("up", "ALERTS") or name in records:
            continue
        if ":" in name:
            missing.append(name + " (a recording rule no rules file defines)")
            continue
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name in families or name in samples or families.get(base) == "histogram":
            continue
        missing.append(name)
    if not wanted:
        print("no metric names found in %s" % argv[1])
        return 1
    if missing:
        for m in missing:
            print("missing from the scrapes: %s" % m)
        return 1
    print("ok   %d metrics of %s exist in the scrapes" % (len(wanted - records - {"up", "ALERTS"}), argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
