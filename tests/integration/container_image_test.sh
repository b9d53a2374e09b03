#!/usr/bin/env bash
# deploy/container/Containerfile, checked without a container builder (none in Debian's CI here):
#   1. hadolint (pinned, from tools/setup.sh) passes it with deploy/container/.hadolint.yaml, and
#      fails a copy that installs recommended packages (the linter really runs).
#   2. The runtime stage installs the Debian package of every shared library the built binaries
#      link (ldd + dpkg -S), and each package it names exists in Debian 12 (installed here).
#   3. The build stage copies exactly the binaries its `bazel build` line builds; the gpu stage
#      copies only what tools/gpu_bundle.sh bundles; every other COPY source is in the repository.
#   container_image_test.sh BINARY...
set -uo pipefail
HADOLINT=/opt/moe-runtime-tools/bin/hadolint
FILE=deploy/container/Containerfile
fail=0
[ -x "$HADOLINT" ] || { echo "FAIL $HADOLINT missing: run tools/setup.sh"; exit 1; }
out="$("$HADOLINT" --config deploy/container/.hadolint.yaml "$FILE" 2>&1)"
rc=$?
if [ "$rc" -ne 0 ] || [ -n "$out" ]; then echo "FAIL hadolint $FILE (rc $rc):"; echo "$out"; fail=1; else
  echo "ok   hadolint $FILE: clean"; fi
bad="$(mktemp "${TEST_TMPDIR:-/tmp}/Containerfile.XXXXXX")"
sed 's/ --no-install-recommends//' "$FILE" >"$bad"
if grep -q DL3015 <<<"$("$HADOLINT" --config deploy/container/.hadolint.yaml "$bad" 2>&1)"; then
  echo "ok   hadolint flags a copy that installs recommended packages (DL3015)"
else
  echo "FAIL hadolint did not flag apt-get install without --no-install-recommends"; fail=1
fi
/usr/bin/python3 - "$FILE" "$@" <<'PY' || fail=1
import os, re, subprocess, sys
path, binaries = sys.argv[1], sys.argv[2:]
text = open(path).read().replace("\\\n", " ")
stages = {}
for m in re.finditer(r"^FROM (\S+) AS (\S+)\n(.*?)(?=^FROM |\Z)", text, re.S | re.M):
    stages[m.group(2)] = m.group(3)
fails = 0
def bad(msg):
    global fails
    print("FAIL " + msg); fails += 1
if set(stages) != {"build", "gpu", "runtime"}:
    bad("stages %s, want build, gpu, runtime" % sorted(stages))
    sys.exit(1)

# 2. runtime packages against the binaries' shared libraries.
m = re.search(r"apt-get install -y --no-install-recommends\s+(.*?)\s+&&", stages["runtime"], re.S)
listed = set(m.group(1).split()) if m else set()
in_base = {"libc6", "libgcc-s1", "libstdc++6"}  # essential in debian:12-slim
libs = {}  # library path -> the binaries linking it
for b in binaries:
    for line in subprocess.run(["ldd", b], capture_output=True, text=True, check=True).stdout.splitlines():
        mm = re.search(r"=> (/\S+)", line)
        if mm:
            libs.setdefault(mm.group(1), set()).add(os.path.basename(b))
def variants(lib):  # merged /usr: dpkg knows a library under one of these names
    return [lib, os.path.realpath(lib), lib[4:] if lib.startswith("/usr") else "/usr" + lib]
# One dpkg -S for every name (it reads its whole database each call).
r = subprocess.run(["dpkg", "-S"] + sorted({v for l in libs for v in variants(l)}), capture_output=True, text=True)
owners = {}
for line in r.stdout.splitlines():
    pkgs, _, p = line.partition(": ")
    owners[p] = pkgs.split(",")[0].split(":")[0].strip()
needed = {}
for lib, users in libs.items():
    pkg = next((owners[v] for v in variants(lib) if v in owners), None)
    if pkg is None:
        bad("%s: %s belongs to no Debian package" % (", ".join(sorted(users)), lib))
    elif pkg not in in_base:
        needed.setdefault(pkg, set()).update(users)
missing = sorted(set(needed) - listed)
for p in missing:
    bad("runtime stage lacks %s (linked by %s)" % (p, ", ".join(sorted(needed[p]))))
if not missing:
    print("ok   runtime stage installs all %d library packages the %d binaries link" % (len(needed), len(binaries)))
for p in sorted(listed):
    if subprocess.run(["dpkg-query", "-W", p], capture_output=True).returncode != 0:
        bad("runtime stage names %s, not a Debian 12 package installed here" % p)

# 3. what the stages copy.
b = stages["build"]
labels = re.search(r"bazel build -c opt ((?://\S+\s*)+)", b).group(1).split()
built = {"bazel-bin/%s" % l[2:].replace(":", "/") for l in labels}
cp = re.search(r"cp (bazel-bin/.*?) /out/bin/", b, re.S).group(1).split()
if set(cp) != built:
    bad("build stage builds %s but copies %s" % (sorted(built), sorted(cp)))
want = {os.path.basename(x) for x in binaries}
if {os.path.basename(x) for x in built} != want:
    bad("build stage builds %s; this test checks the libraries of %s" % (sorted(built), sorted(want)))
else:
    print("ok   build stage copies the %d binaries it builds" % len(built))
bundle = open("tools/gpu_bundle.sh").read()
bundled = {t.split(":")[1] for t in re.findall(r"//[\w/]+:[\w.-]+", bundle)}
for src in re.findall(r"dist/gpu/bin/(\S+)", stages["gpu"]):
    if src not in bundled:
        bad("gpu stage copies dist/gpu/bin/%s, which tools/gpu_bundle.sh does not bundle" % src)
# The repository: where the Containerfile's runfile points (Bazel links runfiles to the sources).
root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(path))))
for stage, body in stages.items():
    for line in re.findall(r"^COPY (?!--from)(.*)$", body, re.M):
        for src in line.split()[:-1]:
            if not src.startswith("dist/gpu") and not os.path.exists(os.path.join(root, src.rstrip("/"))):
                bad("%s stage copies %s, which is not in the repository" % (stage, src))
print("ok   gpu stage copies only what tools/gpu_bundle.sh bundles; every context source exists" if fails == 0 else "")
sys.exit(1 if fails else 0)
PY
exit "$fail"
