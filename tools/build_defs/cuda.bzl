"""cuda_library: compiles .cu files with nvcc into objects wrapped in a cc_library.

Active only under --config=cuda (define cuda=1); without it the library is empty, so
CPU-only machines analyse the same BUILD files. Targets that need the kernels at run
time are tagged "gpu" and filtered out of CPU CI.
"""

NVCC = "/usr/local/cuda/bin/nvcc"

NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "-Xcompiler -fPIC",
    "-gencode arch=compute_90a,code=sm_90a",
    "--expt-relaxed-constexpr",
    "-lineinfo",
]

def cuda_library(name, srcs, hdrs = [], deps = [], cuda_deps = [], copts = [], **kwargs):
    objs = []
    for src in srcs:
        obj = "_objs_cuda/%s/%s.pic.o" % (name, src.replace("/", "_")[:-len(".cu")])
        native.genrule(
            name = "%s_%s_nvcc" % (name, src.replace("/", "_").replace(".", "_")),
            srcs = depset([src] + hdrs + native.glob(["**/*.cuh", "**/*.h"])).to_list(),
            outs = [obj],
            # nvcc names its temporary files after its pid, and actions in bazel's sandboxes
            # share /tmp while each may run as the same pid of its own namespace: two nvcc at
            # once once removed each other's tmpxft files. Each gets a directory of its own.
            cmd = "t=$$(mktemp -d) && TMPDIR=$$t %s %s %s -I. -I$(GENDIR) -c $(location %s) -o $@; rc=$$?; rm -rf $$t; exit $$rc" % (
                NVCC,
                " ".join(NVCC_FLAGS),
                " ".join(copts),
                src,
            ),
            tags = ["cuda"],
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = select({
            "//:cuda_enabled": objs,
            "//conditions:default": [],
        }),
        hdrs = hdrs,
        deps = deps + select({
            "//:cuda_enabled": ["@cuda//:cudart"] + cuda_deps,
            "//conditions:default": [],
        }),
        linkstatic = True,
        **kwargs
    )
