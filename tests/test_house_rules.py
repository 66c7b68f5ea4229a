"""Rules of the package's structure, read from its source with ``ast``.

A module's private names (``_x``) are its own: another module of the package that reads
them breaks on a rename no import shows. Modules named ``_x.py`` are private to the
package and may be imported whole by its other modules."""

from __future__ import annotations

import ast
import os
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "tfhybrid")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _is_module(dotted: str) -> bool:
    base = os.path.join(ROOT, *dotted.split("."))
    return os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reaches(path: str) -> list[str]:
    """Where the module at ``path`` reads another tfhybrid module's private name: as
    ``from tfhybrid.x import _name`` or as ``x._name`` with ``x`` an imported tfhybrid
    module."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    own = _module_name(path)
    modules: dict[str, str] = {}   # local name -> tfhybrid module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "tfhybrid":
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                if _is_module(dotted):
                    modules[alias.asname or alias.name] = dotted
                elif _private(alias.name) and node.module != own:
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tfhybrid":
                    # "import tfhybrid.x" binds "tfhybrid"; "import tfhybrid.x as y", y
                    if alias.asname:
                        modules[alias.asname] = alias.name
                    else:
                        modules["tfhybrid"] = "tfhybrid"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in modules:
                target = ".".join([modules[value.id]] + chain[:0:-1])
                if target != own and not _is_module(f"{target}.{node.attr}"):
                    found.append(f"{node.lineno}: {target}.{node.attr}")
    return found


def private_module_imports(path: str) -> list[str]:
    """Where the module at ``path`` imports a private module of the package (a dotted
    path with a ``_x`` part), e.g. ``from tfhybrid import _tf_internals``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "tfhybrid":
            dotted = [f"{node.module}.{a.name}" for a in node.names]
            dotted = [d for d in dotted if _is_module(d)] + [node.module]
        elif isinstance(node, ast.Import):
            dotted = [a.name for a in node.names if a.name.split(".")[0] == "tfhybrid"]
        else:
            continue
        found += [f"{node.lineno}: {d}" for d in dict.fromkeys(dotted)
                  if any(_private(part) for part in d.split("."))]
    return found


# the one package that may import TensorFlow's and Keras' private packages, read their
# private attributes, set attributes on their objects and patch them
DOOR = "tfhybrid._tf_internals"


def in_door(module: str) -> bool:
    return module == DOOR or module.startswith(DOOR + ".")
PRIVATE_PACKAGES = ("tensorflow.python", "keras.src", "tf_keras.src")


def private_tf_imports(path: str) -> list[str]:
    """Where the module at ``path`` imports a private package of TensorFlow or Keras."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                 [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        found += [f"{node.lineno}: {n}" for n in names
                  if any(n == p or n.startswith(p + ".") for p in PRIVATE_PACKAGES)]
    return found


# the prefix of the attributes that once carried facts on TF objects (tfhybrid.roles
# carries them now)
TAG_PREFIX = "_tfhybrid_"


def tags_set(path: str) -> list[str]:
    """Where the module at ``path`` sets a ``_tfhybrid_*`` attribute on an object: an
    assignment to ``x._tfhybrid_y``, or ``setattr(x, "_tfhybrid_y", ...)`` with the
    name written out or held in a module constant."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        found += [f"{node.lineno}: .{t.attr}" for t in targets
                  if isinstance(t, ast.Attribute) and t.attr.startswith(TAG_PREFIX)]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "setattr" and len(node.args) >= 2):
            name = node.args[1]
            text = (name.value if isinstance(name, ast.Constant) else
                    constants.get(name.id) if isinstance(name, ast.Name) else None)
            if isinstance(text, str) and text.startswith(TAG_PREFIX):
                found.append(f"{node.lineno}: setattr {text}")
    return found


# private names of the standard library that are its documented API
STDLIB_PRIVATE = {"os._exit"}


def foreign_private_reads(path: str) -> list[str]:
    """Where the module at ``path`` reads a private attribute of an object it does not
    own: anything but ``self``, ``cls``, ``super()`` or a class of its own. TensorFlow's
    and Keras' private attributes are read in the door only."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        if _own(node.value, classes):
            continue
        text = ast.unparse(node)
        if text not in STDLIB_PRIVATE:
            found.append(f"{node.lineno}: {text}")
    # the private attributes the module gives its own objects (a probe of self for one
    # of these reads the module's own state; of any other, a base class's of another
    # library)
    set_here = {t.attr for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(t, ast.Attribute)}
    set_here |= {t.id for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                 for n in c.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                 for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                 if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        # getattr(x, "_name"), hasattr, setattr, delattr: the same read by another spelling
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str) and _private(node.args[1].value)
                and not (_own(node.args[0], classes) and node.args[1].value in set_here)):
            found.append(f"{node.lineno}: {node.func.id}({ast.unparse(node.args[0])}, "
                         f"{node.args[1].value!r})")
    return found


def _own(owner: ast.AST, classes: set[str]) -> bool:
    """Whether ``owner`` is the module's own object: ``self``, ``cls``, ``super()`` or
    one of its classes."""
    if isinstance(owner, ast.Name):
        return owner.id in ("self", "cls") or owner.id in classes
    return isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) \
        and owner.func.id == "super"


# objects of the standard library a module may keep its own state on
STDLIB_STATE = {"threading.local", "types.SimpleNamespace"}


def foreign_attribute_stores(path: str) -> list[str]:
    """Where the module at ``path`` sets an attribute on an object it does not own: an
    assignment to ``x.a`` (or ``setattr``/``object.__setattr__``/``delattr`` on ``x``)
    where ``x`` is not ``self``, ``cls`` or a class of the module, nor a name bound only
    to one of those, to an instance of a class of the module (made by a call, returned
    by a function of the module annotated so, or a parameter annotated so) or to
    standard-library state (``STDLIB_STATE``). Facts
    about other libraries' objects live in tfhybrid's registries; patches in the door.
    """
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    # the module's functions that return an instance of one of its classes
    makers = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
              and n.returns is not None
              and ast.unparse(n.returns).strip("'\"") in classes}

    def made_here(value: ast.AST) -> bool:
        if isinstance(value, ast.Name):
            return value.id in ("self", "cls")
        return isinstance(value, ast.Call) and (
            (isinstance(value.func, ast.Name) and value.func.id in classes | makers)
            or ast.unparse(value.func) in STDLIB_STATE)

    bound: dict[str, list[bool]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    bound.setdefault(target.id, []).append(made_here(node.value))
        elif isinstance(node, ast.arg) and node.annotation is not None:
            annotation = ast.unparse(node.annotation).strip("'\"")
            bound.setdefault(node.arg, []).append(annotation in classes)
    owned = {name for name, kinds in bound.items() if all(kinds)}

    def foreign(owner: ast.AST) -> bool:
        return not (_own(owner, classes)
                    or (isinstance(owner, ast.Name) and owner.id in owned))

    found = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and isinstance(part.ctx, ast.Store) \
                        and foreign(part.value):
                    found.append(f"{node.lineno}: {ast.unparse(part)} =")
        if isinstance(node, ast.Call) and node.args:
            name = ast.unparse(node.func)
            owner = node.args[0]
            if name in ("setattr", "delattr") and foreign(owner):
                found.append(f"{node.lineno}: {name}({ast.unparse(owner)}, ...)")
            elif name == "object.__setattr__" and foreign(owner):
                found.append(f"{node.lineno}: object.__setattr__({ast.unparse(owner)}, ...)")
    return found


def imported_modules(path: str) -> set[str]:
    """The package's modules that the module at ``path`` imports, at its top or inside a
    function: ``from tfhybrid.x import y`` counts ``tfhybrid.x.y`` where that is a module,
    else ``tfhybrid.x``; importing a module imports the packages above it too."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    own = _module_name(path)
    named = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "tfhybrid":
            named += [f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}")
                      else node.module for a in node.names]
        elif isinstance(node, ast.Import):
            named += [a.name for a in node.names if a.name.split(".")[0] == "tfhybrid"]
    found = set()
    for dotted in named:
        parts = dotted.split(".")
        for end in range(2, len(parts) + 1):
            module = ".".join(parts[:end])
            # a package's own modules import it; the lazy top package imports nothing
            if _is_module(module) and module != own and not own.startswith(module + "."):
                found.add(module)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def package_files() -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(PACKAGE)
                  for f in files if f.endswith(".py"))


def suite_files() -> list[str]:
    folder = os.path.join(ROOT, "tests")
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".py"))


def source_file(test: unittest.TestCase, text: str, in_package: bool = False) -> str:
    """A Python file holding ``text`` (inside ``tfhybrid/`` with ``in_package``, where
    a module's own name counts), removed when ``test`` ends."""
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".py", dir=PACKAGE if in_package else None,
                                     delete=False) as f:
        f.write(text)
    test.addCleanup(os.remove, f.name)
    return f.name


# distributed-embeddings' own private name, which DE users' scripts call: the drop-in
# keeps it, and its compatibility test calls it by that name
DE_PRIVATE_NAMES = {"_dp_to_mp_input"}
# the tests of the door itself, the one place a test imports it
DOOR_TESTS = {"test_tf_internals.py"}


class PrivateNamesTest(unittest.TestCase):

    def test_no_module_of_the_package_reads_another_modules_private_names(self):
        reaches = {os.path.relpath(p, ROOT): private_reaches(p) for p in package_files()}
        self.assertEqual({p: r for p, r in reaches.items() if r}, {})

    def test_only_the_door_imports_tensorflow_and_keras_internals(self):
        reaches = {_module_name(p): private_tf_imports(p) for p in package_files()}
        self.assertEqual({m: r for m, r in reaches.items() if r and not in_door(m)}, {})
        self.assertTrue(reaches[DOOR + ".reads"])   # the check reads the door too
        # the checkpoint package is scanned
        self.assertIn("tfhybrid.checkpoint.writer", reaches)

    def test_only_the_door_reads_private_attributes_of_other_objects(self):
        reads = {_module_name(p): foreign_private_reads(p) for p in package_files()}
        self.assertEqual({m: r for m, r in reads.items() if r and not in_door(m)}, {})
        # the door does, so the check sees such reads
        self.assertTrue(reads[DOOR + ".reads"])

    def test_only_the_door_sets_attributes_on_other_libraries_objects(self):
        stores = {_module_name(p): foreign_attribute_stores(p) for p in package_files()}
        self.assertEqual({m: r for m, r in stores.items() if r and not in_door(m)}, {})
        self.assertTrue(stores[DOOR + ".hooks"])   # the door does: the check sees it

    def test_the_attribute_store_check_sees_a_store(self):
        path = source_file(self, (
            "import threading\nclass A:\n    def f(self, model, mine: 'A'):\n"
            "        self.a = 1; mine.b = 2; model.c = 3; outer = self; outer.d = 4\n"
            "        made = A(); made.e = 5; setattr(model, 'f', 6)\n"
            "        object.__setattr__(model, 'g', 7); getattr(model, '_h', 8)\n"
            "        self._j = 1; getattr(self, '_j'); getattr(self, '_keras_k')\n"
            "STATE = threading.local()\nSTATE.i = 9\n"))
        self.assertEqual(foreign_attribute_stores(path),
                         ["4: model.c =", "5: setattr(model, ...)",
                          "6: object.__setattr__(model, ...)"])
        self.assertEqual(foreign_private_reads(path), ["6: getattr(model, '_h')",
                                                         "7: getattr(self, '_keras_k')"])

    def test_tests_read_only_public_names(self):
        # tests go through the public API or tfhybrid.testing, so a rename inside the
        # package breaks no test that does not call it
        reads = {}
        for path in suite_files():
            found = [r for r in private_reaches(path) + foreign_private_reads(path)
                     if r.rsplit(".", 1)[-1] not in DE_PRIVATE_NAMES]
            if os.path.basename(path) not in DOOR_TESTS:
                found += private_module_imports(path)
            if found:
                reads[os.path.relpath(path, ROOT)] = found
        self.assertEqual(reads, {})

    def test_the_private_module_check_sees_an_import(self):
        path = source_file(self, (
            "import tfhybrid\nfrom tfhybrid import _tf_internals, mesh\n"
            "from tfhybrid._tf_internals import KERAS_MAJOR\n"))
        self.assertEqual(private_module_imports(path),
                         ["2: tfhybrid._tf_internals", "3: tfhybrid._tf_internals"])

    def test_the_private_read_check_sees_a_read(self):
        path = source_file(self, (
            "class A:\n    def f(self, m):\n        self._a; super()._b; A._c\n"
            "        m._d; self.model._e; os._exit(0)\n"))
        self.assertEqual(foreign_private_reads(path), ["4: m._d", "4: self.model._e"])

    def test_no_module_tags_objects_with_attributes(self):
        # the door marks its own wrapper functions (a hook installed once); nothing else
        tagged = {_module_name(p): tags_set(p) for p in package_files()}
        self.assertEqual({m: t for m, t in tagged.items() if t and not in_door(m)}, {})

    def test_the_tag_check_sees_a_tag(self):
        path = source_file(self, (
            '_A = "_tfhybrid_a"\nv._tfhybrid_b = 1\nsetattr(v, _A, 2)\n'
            'setattr(v, "_tfhybrid_c", 3)\nsetattr(v, "plain", 4)\n'))
        self.assertEqual(tags_set(path), ["2: ._tfhybrid_b", "3: setattr _tfhybrid_a",
                                            "4: setattr _tfhybrid_c"])

    def test_the_check_sees_a_reach(self):
        # the rule's own check must be able to fail
        path = source_file(self, (
            "from tfhybrid import mesh as m\nfrom tfhybrid.fiited import _x\n"
            "import tfhybrid.planner\nm._MESH\ntfhybrid.planner._human(1)\n"), in_package=True)
        self.assertEqual(private_reaches(path),
                         ["2: from tfhybrid.fiited import _x", "4: tfhybrid.mesh._MESH",
                          "5: tfhybrid.planner._human"])


# a module does one job in at most this many lines, except the two whose docstring says
# why they are one module (the app's one sequence; the datasets' one sharding contract)
MAX_MODULE_LINES = 800
LONG_MODULES = {"tfhybrid.train.app", "tfhybrid.train.data"}


class SizesTest(unittest.TestCase):

    def test_no_module_is_over_the_limit_unless_its_docstring_says_why(self):
        sizes = {}
        for path in package_files():
            with open(path, encoding="utf-8") as f:
                text = f.read()
            sizes[_module_name(path)] = (text.count("\n"), ast.get_docstring(ast.parse(text)))
        too_long = {m: n for m, (n, _) in sizes.items()
                    if n > MAX_MODULE_LINES and m not in LONG_MODULES}
        self.assertEqual(too_long, {})
        for module in LONG_MODULES:
            self.assertIn("one module", (sizes[module][1] or "").lower(), module)

# What names a storage kind: its modules, its table and store classes, its name's constant.
KIND_PACKAGES = ("tfhybrid.fiited", "tfhybrid.tiers", "tfhybrid.dynamic")
KIND_NAMES = {"KERNEL", "FIITED", "TIERED", "TIERED_FIITED", "CUSTOM", "KernelTable",
              "FiitedPool", "TieredCache", "CustomLayerTable", "ChunkedTable", "CachedTable",
              "ChunkedCachedTable", "ChunkOptions", "DynamicTable"}
# Where a kind may be named: the kinds' own modules (and the registry and the spec that
# map a kind's name to them), and what users set: the layers' options
# (``Embedding(dims="adaptive", cache_rows=...)``), the planner's tier placement, the
# app's flags and the FIITED callback.
# (the sharding kinds' ways of owning rows too: a hash-wise shard owns keys by their mixer)
KIND_MODULES = KIND_PACKAGES + ("tfhybrid.sharding.stores", "tfhybrid.sharding.tables",
                                "tfhybrid.sharding.ownership")
USER_FACING = ("tfhybrid.layers", "tfhybrid.plan", "tfhybrid.train", "tfhybrid.callbacks")


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def kind_names(path: str) -> list[str]:
    """Where the module at ``path`` names a storage kind: imports a kind's module, or
    uses a kind's class or constant (``KIND_NAMES``) by name or attribute."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            dotted = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            kinds = [d for d in dotted if _within(d, KIND_PACKAGES)]
            if kinds:
                found.append(f"{node.lineno}: import {kinds[-1]}")
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if a.name in KIND_NAMES and not kinds]
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if _within(a.name, KIND_PACKAGES)]
        elif isinstance(node, ast.Name) and node.id in KIND_NAMES:
            found.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in KIND_NAMES:
            found.append(f"{node.lineno}: .{node.attr}")
    return sorted(set(found), key=lambda r: (int(r.split(":")[0]), r))


class KindsTest(unittest.TestCase):

    def test_only_the_kinds_modules_and_user_facing_options_name_a_kind(self):
        named = {_module_name(p): kind_names(p) for p in package_files()}
        elsewhere = {m: n for m, n in named.items()
                     if n and not _within(m, KIND_MODULES + USER_FACING)}
        self.assertEqual(elsewhere, {})
        # the check reads the kinds' modules too, and sees them name kinds
        self.assertTrue(named["tfhybrid.sharding.stores"])
        self.assertTrue(named["tfhybrid.layers.embedding"])

    def test_the_kind_check_sees_a_kind(self):
        path = source_file(self, (
            "from tfhybrid import fiited\nfrom tfhybrid.tiers import CachedTable\n"
            "import tfhybrid.tiers.cached_table\nfrom tfhybrid.sharding.tables import FIITED\n"
            "from tfhybrid.sharding import stores\nx = stores.TieredCache\n"
            "y = stores.create_store\n"), in_package=True)
        self.assertEqual(kind_names(path), [
            "1: import tfhybrid.fiited", "2: import tfhybrid.tiers.CachedTable",
            "3: import tfhybrid.tiers.cached_table", "4: import FIITED", "6: .TieredCache"])


class ImportsTest(unittest.TestCase):

    def test_no_import_cycle_in_the_package_counting_imports_in_functions(self):
        graph = {_module_name(p): imported_modules(p) for p in package_files()}
        self.assertIn("tfhybrid.roles", graph["tfhybrid.distributed.sync"])
        self.assertEqual(import_cycles(graph), [])

    def test_the_cycle_check_sees_a_cycle(self):
        graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
        self.assertEqual(import_cycles(graph), [["a", "b", "c"]])

    def test_imports_inside_functions_count(self):
        path = source_file(self, (
            "def f():\n    from tfhybrid.tiers import CachedTable\n"
            "    import tfhybrid.distributed.sync\n"), in_package=True)
        self.assertEqual(imported_modules(path),
                         {"tfhybrid.tiers", "tfhybrid.distributed",
                          "tfhybrid.distributed.sync"})


if __name__ == "__main__":
    unittest.main()
