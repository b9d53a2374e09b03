#!/usr/bin/env bash
# deploy/kubernetes, rendered and checked offline:
#   1. `kubectl kustomize` renders every overlay;
#   2. kubernetes-validate (pinned, tools/setup.sh) validates every object strictly against the
#      Kubernetes 1.34 schemas, and rejects a render with an unknown field (the check has teeth);
#   3. the objects fit the daemons: every flag a container passes to moe-rankd / moe-controller is
#      one it declares (--helpfull), every $(VAR) in args is defined, gRPC probes ask the port of
#      --health_listen (readiness: moe.v1.ExpertLayerService on ranks), metrics ports match
#      --metrics_listen, services and the PDB select the pods, rank replicas = MOE_WORLD, the rank
#      and its engine share the socket directory, /dev/shm (and the GPU claim where there is one),
#      and every Secret / PVC not rendered is one docs/deployment.md says to create.
#   kubernetes_manifests_test.sh RANKD CONTROLLER
set -uo pipefail
RANKD="$1" CONTROLLER="$2"
VALIDATE=/opt/moe-runtime-tools/bin/kubernetes-validate
[ -x "$VALIDATE" ] || { echo "FAIL $VALIDATE missing: run tools/setup.sh"; exit 1; }
command -v kubectl >/dev/null || { echo "FAIL kubectl missing: run tools/setup.sh"; exit 1; }
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/k8s.XXXXXX")"
"$RANKD" --helpfull >"$work/rankd.help" 2>&1
"$CONTROLLER" --helpfull >"$work/controller.help" 2>&1
fail=0
# kustomize does not read Bazel's symlinked runfiles: render a dereferenced copy.
cp -rL deploy/kubernetes "$work/kubernetes"
overlays=$(ls -d "$work"/kubernetes/overlays/*/)
[ -n "$overlays" ] || { echo "FAIL no overlays"; exit 1; }
for dir in $overlays; do
  o="$(basename "$dir")"
  if ! kubectl kustomize "$dir" >"$work/$o.yaml" 2>"$work/$o.err"; then
    echo "FAIL kubectl kustomize $dir:"; cat "$work/$o.err"; fail=1; continue
  fi
  echo "ok   $o: rendered ($(grep -c '^kind:' "$work/$o.yaml") objects)"
  if ! out="$("$VALIDATE" --strict --quiet -k 1.34.0 "$work/$o.yaml" 2>&1)" || [ -n "$out" ]; then
    echo "FAIL $o: kubernetes-validate:"; echo "$out"; fail=1
  else
    echo "ok   $o: every object valid against the Kubernetes 1.34 schemas (strict)"
  fi
  /usr/bin/python3 - "$work/$o.yaml" "$work/rankd.help" "$work/controller.help" <<'PY' || fail=1
import re, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
helps = {"moe-rankd": open(sys.argv[2]).read(), "moe-controller": open(sys.argv[3]).read()}
name = sys.argv[1].rsplit("/", 1)[-1][:-5]
external = {("Secret", "moe-tls"), ("Secret", "moe-tokens"), ("PersistentVolumeClaim", "moe-checkpoints")}
fails = []
by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
def find(kind, prefix):
    for (k, n), d in by.items():
        if k == kind and (n == prefix or re.fullmatch(re.escape(prefix) + r"-[a-z0-9]{10}", n)):
            return d
settings = find("ConfigMap", "moe-runtime")
config = settings["data"] if settings else {}
sets = {n: d for (k, n), d in by.items() if k == "StatefulSet"}
for want in ("moe-controller", "moe-rank"):
    if want not in sets:
        fails.append("no StatefulSet %s" % want)
for sname, s in sets.items():
    pod = s["spec"]["template"]
    labels = pod["metadata"].get("labels", {})
    sel = s["spec"]["selector"]["matchLabels"]
    if any(labels.get(k) != v for k, v in sel.items()):
        fails.append("%s: selector %s does not match its pod labels" % (sname, sel))
    vols = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    vols.update({t["metadata"]["name"]: {"pvc": True} for t in s["spec"].get("volumeClaimTemplates", [])})
    for v in vols.values():
        for key, kind, field in (("secret", "Secret", "secretName"), ("persistentVolumeClaim", "PersistentVolumeClaim", "claimName"),
                                 ("configMap", "ConfigMap", "name")):
            if key in v:
                ref = v[key][field]
                if (kind, ref) not in by and (kind, ref) not in external:
                    fails.append("%s: volume refers to %s %s, neither rendered nor documented" % (sname, kind, ref))
    for c in pod["spec"]["containers"]:
        where = "%s/%s" % (sname, c["name"])
        for m in c.get("volumeMounts", []):
            if m["name"] not in vols:
                fails.append("%s: mounts %s, no such volume" % (where, m["name"]))
        for ef in c.get("envFrom", []):
            ref = ef.get("configMapRef", {}).get("name")
            if ref and ("ConfigMap", ref) not in by:
                fails.append("%s: envFrom ConfigMap %s not rendered" % (where, ref))
        cmd = (c.get("command") or [""])[0]
        if cmd not in helps:
            continue
        args = c.get("args", [])
        flags = {}
        for a in args:
            m = re.fullmatch(r"(--[a-z_]+)=(.*)", a)
            if not m:
                fails.append("%s: argument %r is not --flag=value" % (where, a)); continue
            flags[m.group(1)] = m.group(2)
            if not re.search(r"^ +%s \(" % re.escape(m.group(1)), helps[cmd], re.M):
                fails.append("%s: %s declares no flag %s" % (where, cmd, m.group(1)))
        env = {e["name"] for e in c.get("env", [])} | set(config)
        for a in args:
            for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", a):
                if var not in env:
                    fails.append("%s: %s uses $(%s), which no env or ConfigMap defines" % (where, a, var))
        hport = int(flags.get("--health_listen", ":0").rsplit(":", 1)[1])
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            p = c.get(probe)
            if p is None:
                continue
            if "grpc" not in p or p["grpc"]["port"] != hport or hport == 0:
                fails.append("%s: %s is not a gRPC probe of --health_listen's port %d" % (where, probe, hport))
        for probe in ("livenessProbe", "readinessProbe"):
            if probe not in c:
                fails.append("%s: no %s" % (where, probe))
        want_ready = "moe.v1.ExpertLayerService" if cmd == "moe-rankd" else None
        if c.get("readinessProbe", {}).get("grpc", {}).get("service") != want_ready:
            fails.append("%s: readiness asks service %r, want %r" % (where, c.get("readinessProbe", {}).get("grpc", {}).get("service"), want_ready))
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        for flag, pname in (("--metrics_listen", "metrics"), ("--health_listen", "health")):
            if flag in flags and ports.get(pname) != int(flags[flag].rsplit(":", 1)[1]):
                fails.append("%s: port %s %s, %s says %s" % (where, pname, ports.get(pname), flag, flags[flag]))
        if cmd == "moe-rankd":
            world = config.get("MOE_WORLD")
            if flags.get("--world") != "$(MOE_WORLD)" or str(s["spec"]["replicas"]) != world:
                fails.append("%s: %s replicas for MOE_WORLD=%s" % (sname, s["spec"]["replicas"], world))
            if s["spec"].get("podManagementPolicy") != "Parallel":
                fails.append("%s: ranks must start in parallel (the group forms with all of them)" % sname)
            engine = [e for e in pod["spec"]["containers"] if e["name"] == "engine"]
            if not engine:
                fails.append("%s: no engine container beside moe-rankd" % sname)
            else:
                mine = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
                theirs = {m["mountPath"]: m["name"] for m in engine[0]["volumeMounts"]}
                sock_dir = flags["--engine_socket"].rsplit("/", 1)[0]
                for path in (sock_dir, "/dev/shm"):
                    if path not in mine or mine.get(path) != theirs.get(path):
                        fails.append("%s: rank and engine do not share %s" % (sname, path))
                if vols.get(mine.get("/dev/shm"), {}).get("emptyDir", {}).get("medium") != "Memory":
                    fails.append("%s: /dev/shm is not a memory emptyDir" % sname)
                claims = [{x["name"] for x in k.get("resources", {}).get("claims", [])} for k in (c, engine[0])]
                pod_claims = {x["name"] for x in pod["spec"].get("resourceClaims", [])}
                if claims[0] != claims[1] or not claims[0] <= pod_claims:
                    fails.append("%s: rank claims %s, engine %s, pod %s" % (sname, claims[0], claims[1], pod_claims))
                for rc in pod["spec"].get("resourceClaims", []):
                    if ("ResourceClaimTemplate", rc.get("resourceClaimTemplateName")) not in by:
                        fails.append("%s: claim template %s not rendered" % (sname, rc.get("resourceClaimTemplateName")))
                if "nccl" in flags.get("--transport", "") and not claims[0]:
                    fails.append("%s: NCCL ranks without a GPU claim" % sname)
for (k, n), d in by.items():
    if k in ("Service", "PodDisruptionBudget"):
        sel = d["spec"]["selector"]
        sel = sel.get("matchLabels", sel)
        if not any(all(s["spec"]["template"]["metadata"]["labels"].get(a) == b for a, b in sel.items()) for s in sets.values()):
            fails.append("%s %s selects no pods" % (k, n))
    if k == "Service" and d["spec"].get("clusterIP") == "None":
        owner = [s for s in sets.values() if s["spec"]["serviceName"] == n]
        if not owner:
            fails.append("headless Service %s governs no StatefulSet" % n)
for f in fails:
    print("FAIL %s: %s" % (name, f))
if not fails:
    print("ok   %s: flags, variables, probes, ports, selectors, shared volumes and references fit the daemons" % name)
sys.exit(1 if fails else 0)
PY
done
# The schema check has teeth: an unknown field in a probe is rejected.
sed 's/periodSeconds: 2$/periodSecond: 2/' "$work/$o.yaml" >"$work/bad.yaml"
if grep -q periodSecond: "$work/bad.yaml" && ! "$VALIDATE" --strict --quiet -k 1.34.0 "$work/bad.yaml" >/dev/null 2>&1; then
  echo "ok   kubernetes-validate rejects a render with an unknown field"
else
  echo "FAIL kubernetes-validate accepted an unknown field (or the mutation found nothing)"; fail=1
fi
exit "$fail"
