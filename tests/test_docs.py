"""The docs test: README.md and docs/*.md say only what runs and link only what exists.

- Every fenced ``python`` block runs as a complete script in a subprocess of its own
  (``sys.executable``, cwd = the repository root, a time limit); a failure names the file,
  the block's line and the tail of its stderr. Single-process blocks run two at a time
  (one thread each on this machine's two cores).
- A block that needs several ranks is marked on the line just before its fence with
  ``<!-- docs-test: horovodrun -np 4 (reason) -->`` and runs under the horovodrun beside
  ``sys.executable`` (``-np N -H localhost:N --gloo``). A block that cannot run here at
  all is marked ``<!-- docs-test: skip: reason -->``: it is reported as a skipped subtest
  with its reason, never silently, and there may be at most ``MAX_SKIPPED`` of them.
- Every relative link (``[x](docs/foo.md)``, ``[x](foo.md#anchor)``, ``[x](#anchor)``,
  ``[x](../tfhybrid/...)``) must reach an existing file, and an anchor a heading of the
  target (GitHub's slugs: lowercase, punctuation but ``-`` and ``_`` dropped, spaces to
  ``-``, repeats numbered ``-1``, ``-2``, ...).
- README.md has at most ``README_MAX_LINES`` lines.
- docs/benchmarks.md is the page ``benchmarks/docs_page.py`` renders now from its template
  and the results files: each measured figure is a placeholder naming its file and line,
  the template holds no figure with a decimal point typed by hand, and every results path
  the page names exists. Integers are not checked (most are a workload's sizes).

One process; it starts jobs of its own (`STARTS_JOBS`: the runner runs it beside one-process
modules only).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import doctest
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STARTS_JOBS = True   # it starts subprocesses and horovodrun jobs of its own
RUN_TIMEOUT_S = 1200     # the runner's limit for the whole module

README_MAX_LINES = 250
MAX_SKIPPED = 2          # blocks that cannot run here at all: keep them very few
BLOCK_TIMEOUT_S = 300    # per block (a horovodrun block starts TF and Horovod on N ranks)
PARALLEL_BLOCKS = 2      # single-process blocks at a time
STDERR_TAIL_LINES = 40

BLOCK_ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "OMP_NUM_THREADS": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
}

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:(?P<body>.*?)-->\s*$")
_HOROVODRUN = re.compile(r"^horovodrun\s+-np\s+(?P<np>\d+)\s+\((?P<reason>.+)\)$")
_SKIP = re.compile(r"^skip:\s*(?P<reason>\S.*)$")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(?P<text>.*?)\s*#*\s*$")
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(?P<target><[^>]*>|[^)\s]+)"
                          r"(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(?P<target>\S+)")
_CODE_SPAN = re.compile(r"(`+)(?:.|\n)*?\1")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def doc_files() -> list[str]:
    """README.md and every docs/*.md, as paths relative to the repository root."""
    docs = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return ["README.md"] + docs


@dataclasses.dataclass(frozen=True)
class Block:
    path: str            # relative to the root
    line: int            # 1-based line of the opening fence
    code: str
    ranks: int = 1       # > 1: run under horovodrun -np ranks
    skip: str | None = None

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


@dataclasses.dataclass(frozen=True)
class Parsed:
    blocks: list          # python Blocks
    problems: list        # malformed or orphaned markers: "path:line: what"
    prose: str            # the text outside fenced blocks (for links and headings)


def parse(path: str) -> Parsed:
    """The file's python blocks with their markers, marker problems, and its prose."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, problems, prose = [], [], []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            marker = _MARKER.match(lines[i])
            if marker:
                following = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
                if not following or following.group("info") != "python":
                    problems.append(f"{path}:{i + 1}: a docs-test marker must be on the line "
                                    "just before a ```python fence")
            prose.append(lines[i])
            i += 1
            continue
        opening, indent = fence.group("fence"), len(fence.group("indent"))
        start = i
        body = []
        i += 1
        while i < len(lines):
            stripped = lines[i].strip()
            if stripped.startswith(opening[0] * len(opening)) and not stripped.strip(opening[0]):
                break
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1   # past the closing fence (or the end of an unclosed block)
        prose.append("")
        if fence.group("info") != "python":
            continue
        ranks, skip = 1, None
        marker = _MARKER.match(lines[start - 1]) if start > 0 else None
        if marker:
            body_text = marker.group("body").strip()
            run = _HOROVODRUN.match(body_text)
            skipped = _SKIP.match(body_text)
            if run and int(run.group("np")) >= 2:
                ranks = int(run.group("np"))
            elif skipped:
                skip = skipped.group("reason").strip()
            else:
                problems.append(
                    f"{path}:{start}: unknown docs-test marker {body_text!r}; expected "
                    "'horovodrun -np N (reason)' with N >= 2 or 'skip: reason'")
        blocks.append(Block(path, start + 1, "\n".join(body) + "\n", ranks, skip))
    return Parsed(blocks, problems, "\n".join(prose))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text (without the repeat suffix)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link: its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    """Every heading anchor of a markdown file (GitHub numbers repeats -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for line in parse(path).prose.splitlines():
        heading = _HEADING.match(line)
        if not heading:
            continue
        base = slug(heading.group("text"))
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def links(path: str) -> list[str]:
    """The link targets of a markdown file's prose (code blocks and code spans left out)."""
    prose = _CODE_SPAN.sub("", parse(path).prose)
    targets = [m.group("target").strip("<>") for m in _INLINE_LINK.finditer(prose)]
    targets += [m.group("target") for line in prose.splitlines()
                if (m := _REFERENCE_LINK.match(line))]
    return targets


def broken_links(path: str) -> list[str]:
    """Each relative link of ``path`` whose file or anchor does not exist, described."""
    broken = []
    for target in links(path):
        if _SCHEME.match(target) or target.startswith("//"):
            continue   # an absolute URL: not ours to check here
        file_part, _, anchor = target.partition("#")
        if file_part:
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part))
        else:
            resolved = path
        full = os.path.join(ROOT, resolved)
        if resolved.startswith(".."):
            broken.append(f"{path}: [{target}] leaves the repository")
            continue
        if not os.path.exists(full):
            broken.append(f"{path}: [{target}] -> {resolved} does not exist")
            continue
        if anchor:
            if not resolved.endswith(".md") or os.path.isdir(full):
                broken.append(f"{path}: [{target}] has an anchor but {resolved} is not a "
                              "markdown file")
            elif anchor not in anchors(resolved):
                broken.append(f"{path}: [{target}] -> no heading #{anchor} in {resolved}")
    return broken


@dataclasses.dataclass
class Outcome:
    returncode: int | None   # None: killed at the time limit
    stdout: str
    stderr: str
    seconds: float


def run_block(block: Block, workdir: str, legacy_keras: str | None) -> Outcome:
    """Runs ``block`` as a reader would; ``legacy_keras`` is the reader's
    TF_USE_LEGACY_KERAS (None: unset, TensorFlow's default Keras)."""
    script = os.path.join(workdir, _script_name(block))
    with open(script, "w", encoding="utf-8") as f:
        f.write(block.code)
    env = dict(os.environ, **BLOCK_ENV)
    env.pop("TF_USE_LEGACY_KERAS", None)
    if legacy_keras is not None:
        env["TF_USE_LEGACY_KERAS"] = legacy_keras
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    command = [sys.executable, script]
    if block.ranks > 1:
        horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        command = [horovodrun, "-np", str(block.ranks), "-H", f"localhost:{block.ranks}",
                   "--gloo"] + command
    started = time.time()
    # a session of its own, so that a block over its limit goes with all its processes
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=BLOCK_TIMEOUT_S)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:   # a process outside the session holds a pipe
            stdout, stderr = "", "(no output: a process outside the block's session kept it)"
        code = None
    return Outcome(code, stdout, stderr, time.time() - started)


def tail(text: str, lines: int = STDERR_TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _with_doc_lines(text: str, block: Block) -> str:
    """A traceback's lines of the block's script, also as lines of the markdown file."""
    def doc_line(match):
        return f"{match.group(0)} ({block.path} line {block.line + int(match.group(1))})"
    return re.sub(r'File "[^"]*' + re.escape(_script_name(block)) + r'", line (\d+)',
                  doc_line, text)


def _script_name(block: Block) -> str:
    return re.sub(r"\W", "_", block.name) + ".py"


BENCHMARKS_PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
_RESULTS_PATH = re.compile(r"benchmarks/results/[\w./-]*[\w/]")


def missing_results(page: str = BENCHMARKS_PAGE, root: str = ROOT) -> list[str]:
    """The ``benchmarks/results/...`` paths ``page``'s prose names that do not exist (a
    command in a code block may name the folder its next run creates)."""
    with open(page, encoding="utf-8") as f:
        prose = re.sub(r"^```.*?^```", "", f.read(), flags=re.S | re.M)
    named = sorted(set(_RESULTS_PATH.findall(prose)))
    return [name for name in named if not os.path.exists(os.path.join(root, name))]


def _load_script(name: str, path: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _shell_lines(path: str) -> list[str]:
    """The lines of ``path``'s sh code blocks."""
    lines, inside = [], False
    with open(path, encoding="utf-8") as f:
        for line in f.read().splitlines():
            if line.startswith("```"):
                inside = not inside and line[3:].strip() in ("sh", "bash", "console")
            elif inside:
                lines.append(line.strip())
    return lines


def _benchmark_catalog():
    return _load_script("benchmark_catalog", "benchmarks/catalog.py")


def _log(block: Block, outcome: Outcome) -> None:
    status = ("timed out" if outcome.returncode is None else
              "ok" if outcome.returncode == 0 else f"exit {outcome.returncode}")
    ranks = f" [np={block.ranks}]" if block.ranks > 1 else ""
    print(f"docs block {block.name}{ranks}: {status} in {outcome.seconds:.1f} s",
          file=sys.stderr, flush=True)


def check_blocks(test: unittest.TestCase, blocks: list[Block],
                 legacy_keras: str | None) -> None:
    """Runs every block not marked skip as a reader with ``legacy_keras`` would
    (``run_block``), multi-rank ones alone and the rest two at a time, and fails a
    subtest of ``test`` per block that fails or overruns, with its stderr's tail."""
    workdir = tempfile.mkdtemp(prefix="tfhybrid-docs-")
    test.addCleanup(shutil.rmtree, workdir, ignore_errors=True)
    runnable = [b for b in blocks if not b.skip]
    outcomes: dict[Block, Outcome] = {}
    # multi-rank blocks alone (their ranks share the cores), the rest two at a time
    for block in (b for b in runnable if b.ranks > 1):
        outcomes[block] = run_block(block, workdir, legacy_keras)
        _log(block, outcomes[block])
    with concurrent.futures.ThreadPoolExecutor(max_workers=PARALLEL_BLOCKS) as pool:
        futures = {pool.submit(run_block, b, workdir, legacy_keras): b
                   for b in runnable if b.ranks == 1}
        for future in concurrent.futures.as_completed(futures):
            outcomes[futures[future]] = future.result()
            _log(futures[future], outcomes[futures[future]])
    skipped = [b for b in blocks if b.skip]
    print(f"docs test: {len(runnable)} python blocks run, {len(skipped)} skipped"
          + "".join(f"\n  SKIP {b.name}: {b.skip}" for b in skipped),
          file=sys.stderr, flush=True)
    for block in runnable:
        with test.subTest(block=block.name):
            outcome = outcomes[block]
            where = f"{block.name}: python block" + (
                f" (horovodrun -np {block.ranks})" if block.ranks > 1 else "")
            if outcome.returncode is None:
                test.fail(f"{where} ran over its {BLOCK_TIMEOUT_S} s limit\n--- stderr "
                          f"tail ---\n{_with_doc_lines(tail(outcome.stderr), block)}")
            test.assertEqual(outcome.returncode, 0,
                             f"{where} failed with exit code {outcome.returncode}\n"
                             f"--- stderr tail ---\n"
                             f"{_with_doc_lines(tail(outcome.stderr), block)}\n"
                             f"--- stdout tail ---\n{tail(outcome.stdout, 10)}")


def _docs_page():
    return _load_script("benchmark_docs_page", "benchmarks/docs_page.py")


class DocsTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.parsed = {path: parse(path) for path in doc_files()}
        cls.blocks = [b for p in cls.parsed.values() for b in p.blocks]

    def test_readme_is_short(self):
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            count = len(f.read().splitlines())
        self.assertLessEqual(count, README_MAX_LINES,
                             f"README.md has {count} lines; the front door keeps to "
                             f"{README_MAX_LINES}: move detail to a page in docs/")

    def test_markers(self):
        problems = [p for parsed in self.parsed.values() for p in parsed.problems]
        self.assertEqual(problems, [], "\n".join(problems))
        skipped = [b.name for b in self.blocks if b.skip]
        self.assertLessEqual(len(skipped), MAX_SKIPPED,
                             f"too many python blocks marked skip ({skipped}); make them "
                             "runnable, or mark them horovodrun -np N")

    def test_benchmarks_page_is_rendered_from_the_results_files(self):
        docs_page = _docs_page()
        with open(docs_page.TEMPLATE, encoding="utf-8") as f:
            self.assertEqual(docs_page.typed_figures(f.read()), [],
                             "benchmarks/docs_page.md.in: figures typed by hand (line, "
                             "figure); write each as a placeholder")
        with open(BENCHMARKS_PAGE, encoding="utf-8") as f:
            current = f.read()
        self.assertTrue(current == docs_page.page(),
                        "docs/benchmarks.md is not the page rendered now from "
                        "benchmarks/docs_page.md.in and the results files: edit the "
                        "template, then run .venv/bin/python benchmarks/docs_page.py")
        self.assertEqual(missing_results(), [],
                         "docs/benchmarks.md names results files that do not exist")

    def test_benchmark_commands_are_the_catalogs(self):
        # the command quoted under a figure is the one `make bench BENCH=full` runs
        catalog = _benchmark_catalog()
        known = {run.shell() for run in catalog.RUNS}
        # a benchmark script, or any script writing into the published results
        quoted = [line for path in doc_files() for line in _shell_lines(path)
                  if re.match(r"^(sudo )?\.venv[^ ]*/bin/python (benchmarks/|\S+ .*"
                              r"benchmarks/results/)", line)]
        self.assertTrue(quoted, "no benchmark commands found in the docs")
        self.assertEqual([line for line in quoted if line not in known], [],
                         "docs quote benchmark commands that benchmarks/catalog.py does "
                         "not run (catalog.py --list prints its commands)")

    def test_every_results_file_is_written_by_a_catalog_run(self):
        # one current set per benchmark: no run-history folders, no files a script
        # did not write
        catalog = _benchmark_catalog()
        results = os.path.join(ROOT, "benchmarks", "results")
        files = [os.path.relpath(os.path.join(folder, name), results)
                 for folder, _, names in os.walk(results) for name in names]
        self.assertTrue(files)
        self.assertEqual(sorted(f for f in files if catalog.owner_of(f) is None), [],
                         "files under benchmarks/results that no run of "
                         "benchmarks/catalog.py writes")

    def test_benchmark_tools_doctests(self):
        for module in (_benchmark_catalog(), _docs_page()):
            with self.subTest(module=module.__name__):
                self.assertEqual(doctest.testmod(module).failed, 0)

    def test_the_page_check_can_fail(self):
        docs_page = _docs_page()
        with tempfile.TemporaryDirectory() as root:
            results = os.path.join(root, "benchmarks", "results")
            os.makedirs(results)
            with open(os.path.join(results, "r.txt"), "w") as f:
                f.write("# command: x\nstep ms 1234.5 [1200.0, 1250.25]\nratio 2.97x\n")
            template = os.path.join(root, "page.md.in")
            with open(template, "w") as f:
                f.write("## A\n`benchmarks/results/r.txt`: {{r.txt :: step ms}} ms "
                        "[{{r.txt :: step ms :: 3}}], {{r.txt :: ratio}}×\n")
            self.assertTrue(docs_page.page(template, results).endswith(
                "1234.5 ms [1250.25], 2.97×\n"))
            # a rerun's figure reaches the page; a page rendered before it is stale
            with open(os.path.join(results, "r.txt"), "w") as f:
                f.write("# command: x\nstep ms 1300.0 [1200.0, 1350.5]\nratio 3.1x\n")
            self.assertTrue(docs_page.page(template, results).endswith(
                "1300.0 ms [1350.5], 3.1×\n"))
            with open(template, "a") as f:
                f.write("typed 3.1×, kept `0.25`\n```sh\nrun 9.99\n```\n")
            with self.assertRaisesRegex(ValueError, r"\(3, '3\.1'\)"):
                docs_page.page(template, results)
            with self.assertRaisesRegex(ValueError, "no line of r.txt holds 'speed'"):
                docs_page.render("{{r.txt :: speed}}", results)
            page = os.path.join(root, "page.md")
            with open(page, "w") as f:
                f.write("`benchmarks/results/r.txt` and `benchmarks/results/gone.txt`\n"
                        "```sh\nrun --out benchmarks/results/next\n```\n")
            self.assertEqual(missing_results(page, root), ["benchmarks/results/gone.txt"])

    def test_internal_links(self):
        broken = [b for path in self.parsed for b in broken_links(path)]
        self.assertEqual(broken, [], "broken links:\n" + "\n".join(broken))

    def test_python_blocks(self):
        self.assertTrue(self.blocks, "no python blocks found in README.md and docs/")
        # the Keras this suite runs (the runner exports it); tests/test_docs_keras3.py runs
        # them again under TensorFlow's default
        check_blocks(self, self.blocks, os.environ.get("TF_USE_LEGACY_KERAS"))

    def test_skipped_blocks(self):
        """Each block marked skip, reported as a skipped subtest with its reason (its own
        test, so that the blocks that ran still count as a pass)."""
        skipped = [b for b in self.blocks if b.skip]
        if not skipped:
            return
        for block in skipped:
            with self.subTest(block=block.name):
                self.skipTest(f"{block.name}: {block.skip}")


if __name__ == "__main__":
    unittest.main()
