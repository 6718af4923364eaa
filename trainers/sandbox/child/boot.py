"""Entry point of every sandboxed program: the launcher runs ``python -I -S -B -c <stub> LIB MODE
WD HOOK ENTRY FDS``, where the stub puts ``LIB`` (the folder with this file) first on ``sys.path``
and calls :func:`main` (``HOOK`` 1 or 0; ``ENTRY`` the candidate's function name; ``FDS``
comma-separated descriptors).

Runs inside the sandbox, after the launcher has set up the namespaces, the read-only root, the
limits and the seccomp filter. Three modes:

* ``run``: execute ``main.py`` of the working directory as ``__main__`` (``run_program``).
* ``serve``: the candidate process of ``check_program``. Execute ``main.py`` (prompt + completion)
  as module ``__candidate__``, then answer calls: each request is ``(args, kwargs)`` as plain data
  (see ``plain``), each reply ``("ok", value)``, ``("raise", exception name, message)`` or
  ``("unplain", type name)`` when the value is not plain data.
* ``test``: the test process of ``check_program``; it never executes candidate code. Execute
  ``prelude.py`` (the task's prompt, when it is a complete program: its helper functions) and
  ``tests.py`` (defining ``check``), bind the entry point's name to a proxy that sends each call
  to the candidate process, and call ``check(proxy)``. Only when ``check`` returns, and the
  candidate answered every call by the rules, is ``done`` written to the private ``done``
  descriptor, which only this process holds. If a test passes an argument that is not plain data,
  the process writes ``fallback <type>`` there instead and exits with :data:`FALLBACK` (never for a
  value nested too deep: the candidate's own values can be, so that fails the check); if the
  candidate process ends or breaks the protocol, the check fails with :data:`CANDIDATE_FAILED`.
"""
import builtins
import posix
import sys

#: Exit codes of the test process besides 0 (tests passed) and 1 (a test failed).
FALLBACK = 3  # a test passes an argument that is not plain data: use the in-process harness
CANDIDATE_FAILED = 4  # the candidate process ended or broke the protocol during the tests


def _clear_environment():
    # The launcher passes an empty environment, but Python's C-locale coercion (PEP 538) adds
    # LC_CTYPE at start-up even with -I: remove it before the program can import os.
    for k in list(posix.environ):
        posix.unsetenv(k)
    posix.environ.clear()


def _report_and_exit(e: BaseException) -> None:
    """Print the traceback without this file's frames and exit 1 (like an uncaught exception)."""
    tb, here = e.__traceback__, _report_and_exit.__code__.co_filename
    while tb is not None and tb.tb_frame.f_code.co_filename == here:
        tb = tb.tb_next
    e.__traceback__ = tb  # what the default excepthook prints
    sys.excepthook(type(e), e, tb)
    raise SystemExit(1)


def _exec_file(path: str, name: str):
    """Execute ``path`` as module ``name`` (also set as ``sys.modules[name]``); exit 1 on an
    uncaught exception, as the interpreter would."""
    with open(path, "rb") as f:
        src = f.read()
    mod = type(sys)(name)
    mod.__file__ = path
    mod.__builtins__ = builtins
    sys.modules[name] = mod
    try:
        exec(compile(src, path, "exec"), mod.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        if isinstance(e, MemoryError):
            mod.__dict__.clear()  # free memory so that the traceback can be printed
        _report_and_exit(e)
    return mod


def serve(wd: str, entry: str, req_fd: int, resp_fd: int) -> None:
    import plain

    mod = _exec_file(wd + "/main.py", "__candidate__")
    while True:
        try:
            args, kwargs = plain.loads(plain.read_message(req_fd))
        except EOFError:  # the test process is done
            return
        fn = mod.__dict__.get(entry)
        try:
            if fn is None:
                raise NameError("name %r is not defined" % entry)
            reply = ("ok", fn(*args, **kwargs))
        except Exception as e:
            reply = ("raise", type(e).__name__, str(e))
        try:
            body = plain.dumps(reply, envelope=1, subclasses=True)
        except plain.NotPlain as e:
            body = plain.dumps(("unplain", str(e)))
        plain.write_message(resp_fd, body)


class CandidateFailed(BaseException):
    """The candidate process ended or broke the protocol. A ``BaseException``, so that a test's
    ``except Exception`` does not swallow it (and the check fails even if a bare ``except`` does)."""


#: Raised by the candidate, these would steer the test's control flow instead of failing it: a
#: StopIteration from the candidate ends a test's ``all(map(candidate, cases))`` early, as if every
#: case passed. They come back as RuntimeError. (A SystemExit or KeyboardInterrupt raised in the
#: candidate ends the candidate's process, and the check fails; a reply naming them, or any
#: name that is not a builtin ``Exception``, also comes back as RuntimeError.)
_CONTROL_FLOW = (StopIteration, StopAsyncIteration)


def _exception(name, message) -> Exception:
    cls = getattr(builtins, name, None) if type(name) is str else None
    if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, _CONTROL_FLOW):
        return cls(message)
    return RuntimeError("%s: %s" % (name, message))


class Candidate:
    """Stands for the candidate function in the test process: each call crosses to the candidate
    process as plain data; the value that comes back is rebuilt from plain data only."""

    def __init__(self, name: str, req_fd: int, resp_fd: int, done_fd: int):
        self.__name__ = self.__qualname__ = name
        self._fds = (req_fd, resp_fd, done_fd)
        self.failure = None

    def _fail(self, why: str):
        self.failure = self.failure or why
        raise CandidateFailed(self.failure)

    def __call__(self, *args, **kwargs):
        import plain

        req_fd, resp_fd, done_fd = self._fds
        if self.failure is not None:
            raise CandidateFailed(self.failure)
        try:
            body = plain.dumps((args, kwargs), envelope=2)
        except plain.TooDeep:
            # Never a fallback: the candidate's own values can be this deep, and a candidate that
            # could choose the in-process harness could choose its verdict.
            self._fail("a test passes the candidate a value nested deeper than %d containers"
                       % plain.MAX_DEPTH)
        except plain.NotPlain as e:  # the test passes something of a type that cannot cross
            posix.write(done_fd, ("fallback %s\n" % e).encode("utf-8", "replace"))
            posix._exit(FALLBACK)
        try:
            plain.write_message(req_fd, body)
            reply = plain.loads(plain.read_message(resp_fd))
        except (EOFError, OSError):
            self._fail("the candidate process ended during the tests")
        except ValueError as e:
            self._fail("the candidate sent a malformed reply (%s)" % e)
        if type(reply) is tuple and len(reply) == 2 and reply[0] == "ok":
            return reply[1]
        if type(reply) is tuple and len(reply) == 3 and reply[0] == "raise":
            raise _exception(reply[1], reply[2])
        if type(reply) is tuple and len(reply) == 2 and reply[0] == "unplain":
            self._fail("the candidate returned a value that is not plain data (%s)" % (reply[1],))
        self._fail("the candidate sent a malformed reply")


def test(wd: str, entry: str, req_fd: int, resp_fd: int, done_fd: int) -> None:
    mod = type(sys)("__main__")
    mod.__builtins__ = builtins
    sys.modules["__main__"] = mod
    ns = mod.__dict__
    for name in ("prelude.py", "tests.py"):
        try:
            with open(wd + "/" + name, "rb") as f:
                src = f.read()
        except FileNotFoundError:
            continue
        exec(compile(src, wd + "/" + name, "exec"), ns)
    candidate = Candidate(entry, req_fd, resp_fd, done_fd)
    ns[entry] = candidate
    try:
        ns["check"](candidate)
    except CandidateFailed:
        pass
    if candidate.failure is not None:  # also when the test code swallowed it
        sys.stderr.write("sandbox: %s\n" % candidate.failure)
        raise SystemExit(CANDIDATE_FAILED)
    posix.write(done_fd, b"done\n")


def main(mode: str, wd: str, hook: str, entry: str, fds: str) -> None:
    _clear_environment()
    builtins.exit = builtins.quit = sys.exit  # site.py (not loaded: -S) would add these
    if mode != "run":
        import plain  # noqa: F401  (imported before the hook forbids re-imports)
    import guard
    del sys.path[0]  # the child modules' folder: only the standard library stays importable
    if hook == "1":
        guard.install(wd)
    fds = [int(fd) for fd in fds.split(",") if fd]
    if mode == "run":
        sys.argv[:] = [wd + "/main.py"]
        _exec_file(wd + "/main.py", "__main__")
    elif mode == "serve":
        serve(wd, entry, *fds)
    else:
        try:
            test(wd, entry, *fds)
        except SystemExit:
            raise
        except BaseException as e:
            _report_and_exit(e)

