"""cc_grpc_library: compiles .proto files with Debian's protoc and grpc_cpp_plugin.

Bazel 4.2.3's native proto_library needs @com_google_protobuf, which is not available
offline; this macro runs protoc through a genrule and wraps the generated sources in a
cc_library. Generated headers are included as "proto/moe/v1/x.pb.h".
"""

def cc_grpc_library(name, srcs, deps = [], grpc = True, **kwargs):
    outs = []
    hdrs = []
    for src in srcs:
        base = src[:-len(".proto")]
        outs += [base + ".pb.cc", base + ".pb.h"]
        hdrs.append(base + ".pb.h")
        if grpc:
            outs += [base + ".grpc.pb.cc", base + ".grpc.pb.h"]
            hdrs.append(base + ".grpc.pb.h")
    pkg = native.package_name()
    plugin = ""
    if grpc:
        plugin = "--grpc_out=$(GENDIR) --plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin"
    native.genrule(
        name = name + "_gen",
        srcs = srcs + [d + "_srcs" for d in deps],
        outs = outs,
        cmd = "/usr/bin/protoc -I. --cpp_out=$(GENDIR) %s %s" % (
            plugin,
            " ".join(["%s/%s" % (pkg, s) for s in srcs]),
        ),
    )
    native.filegroup(name = name + "_srcs", srcs = srcs)
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = hdrs,
        deps = deps + ["@system//:protobuf", "@system//:grpc++"],
        **kwargs
    )
