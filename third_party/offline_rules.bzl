"""Offline stand-ins for @rules_cc and @rules_java.

Bazel 4.x's embedded @bazel_tools loads @rules_cc//cc:defs.bzl (C++ toolchain BUILD
files) and @rules_java//java:defs.bzl (the always-registered JDK toolchains), and the
default WORKSPACE suffix would download both with http_archive. This network cannot
reach GitHub or the Bazel mirror, and Debian's bazel-rules-cc 0.0.4 needs a newer
@bazel_tools (use_cpp_toolchain) than Debian's bazel-bootstrap 4.2.3 ships. So these
repositories are generated locally: each .bzl forwards to the native rule of the same
name, which is exactly what those rule sets do on Bazel 4. Declaring them in WORKSPACE
before the suffix makes its `maybe(http_archive, ...)` a no-op.
"""

def _forwarders(names):
    return "\n".join([
        "def %s(**kwargs):\n    native.%s(**kwargs)\n" % (n, n)
        for n in names
    ])

_CC_RULES = [
    "cc_binary",
    "cc_import",
    "cc_library",
    "cc_proto_library",
    "cc_test",
    "cc_toolchain",
    "cc_toolchain_suite",
    "fdo_prefetch_hints",
    "fdo_profile",
    "objc_import",
    "objc_library",
]

_JAVA_RULES = [
    "java_binary",
    "java_import",
    "java_library",
    "java_lite_proto_library",
    "java_package_configuration",
    "java_plugin",
    "java_proto_library",
    "java_runtime",
    "java_test",
    "java_toolchain",
]

def _offline_rules_cc_impl(rctx):
    rctx.file("WORKSPACE", 'workspace(name = "rules_cc")\n')
    rctx.file("BUILD", "")
    rctx.file("cc/BUILD", "\n".join([
        'package(default_visibility = ["//visibility:public"])',
        'exports_files(["defs.bzl"])',
        'alias(name = "toolchain_type", actual = "@bazel_tools//tools/cpp:toolchain_type")',
        "",
    ]))
    rctx.file("cc/defs.bzl", "# Generated offline stand-in: forwards to native rules.\n" +
                             _forwarders(_CC_RULES))

def _offline_rules_java_impl(rctx):
    rctx.file("WORKSPACE", 'workspace(name = "rules_java")\n')
    rctx.file("BUILD", "")
    rctx.file("java/BUILD", 'exports_files(["defs.bzl"])\n')
    rctx.file("java/defs.bzl", "# Generated offline stand-in: forwards to native rules.\n" +
                               _forwarders(_JAVA_RULES))

offline_rules_cc = repository_rule(implementation = _offline_rules_cc_impl)
offline_rules_java = repository_rule(implementation = _offline_rules_java_impl)
