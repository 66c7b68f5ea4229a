"""tf_configure: exposes a locally installed TensorFlow (headers + libtensorflow_framework)
as a Bazel repository, like new_local_repository but with the path discovered at fetch time.

Path sources, first match wins:
  1. --repo_env=TF_INCLUDE_DIR=... and --repo_env=TF_LIB_DIR=... (scripts/bazel_build.sh)
  2. running TF_PYTHON (default <workspace>/.venv/bin/python) with tf.sysconfig.
Compile defines (-D...) and the library name (-l:...) always come from
tf.sysconfig.get_compile_flags()/get_link_flags() when Python is available, else the
TF 2.15 defaults below.
"""

_DEFAULT_DEFINES = ["_GLIBCXX_USE_CXX11_ABI=1", "EIGEN_MAX_ALIGN_BYTES=64"]
_DEFAULT_LIB = "libtensorflow_framework.so.2"

_PROBE = """
import tensorflow as tf
print(tf.sysconfig.get_include())
print(tf.sysconfig.get_lib())
print(" ".join(tf.sysconfig.get_compile_flags()))
print(" ".join(tf.sysconfig.get_link_flags()))
"""

def _fail(msg):
    fail("tf_configure: " + msg)

def _impl(rctx):
    env = rctx.os.environ
    include_dir = env.get("TF_INCLUDE_DIR", "")
    lib_dir = env.get("TF_LIB_DIR", "")
    defines = None
    lib_name = None

    python = env.get("TF_PYTHON", "")
    if not python:
        python = str(rctx.path(Label("//:WORKSPACE")).dirname) + "/.venv/bin/python"
    if rctx.path(python).exists:
        res = rctx.execute([python, "-c", _PROBE], timeout = 600, quiet = True)
        if res.return_code != 0:
            _fail("%s could not import tensorflow:\n%s" % (python, res.stderr))
        lines = res.stdout.strip().split("\n")[-4:]
        if not include_dir:
            include_dir = lines[0].strip()
        if not lib_dir:
            lib_dir = lines[1].strip()
        defines = [f[2:] for f in lines[2].split(" ") if f.startswith("-D")]
        for f in lines[3].split(" "):
            if f.startswith("-l:"):
                lib_name = f[3:]
    elif not (include_dir and lib_dir):
        _fail("no TF_INCLUDE_DIR/TF_LIB_DIR and no python at %s (set TF_PYTHON)" % python)

    if defines == None:
        defines = _DEFAULT_DEFINES
    if not lib_name:
        lib_name = _DEFAULT_LIB
    if not rctx.path(include_dir + "/tensorflow/core/framework/op.h").exists:
        _fail("TF headers not found under " + include_dir)
    if not rctx.path(lib_dir + "/" + lib_name).exists:
        _fail("%s not found in %s" % (lib_name, lib_dir))

    rctx.symlink(include_dir, "include")
    rctx.symlink(lib_dir + "/" + lib_name, lib_name)
    rctx.template("BUILD", Label("//third_party/tf:BUILD.tpl"), {
        "%{TF_INCLUDE_DIR}": include_dir,
        "%{TF_LIB_DIR}": lib_dir,
        "%{TF_LIB_NAME}": lib_name,
        "%{TF_DEFINES}": ", ".join(['"%s"' % d for d in defines]),
    }, executable = False)

tf_configure = repository_rule(
    implementation = _impl,
    environ = ["TF_INCLUDE_DIR", "TF_LIB_DIR", "TF_PYTHON"],
    local = True,
    configure = True,
)
