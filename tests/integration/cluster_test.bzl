"""cluster_test: a shell test that drives real processes of the project on one machine.

The script gets the paths of `binaries` as arguments, in the order given; they, `data` and the
cluster scripts' library travel with it.
"""

def cluster_test(name, binaries, data = [], tags = []):
    native.sh_test(
        name = name,
        size = "medium",
        srcs = [name + ".sh"],
        args = ["$(location %s)" % b for b in binaries],
        data = binaries + data,
        tags = tags,
    )
