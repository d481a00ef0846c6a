"""A Harbor task's Dockerfile (and one-service compose file) read as Docker reads it, for the local sandbox.

What is reproduced: ENV and ARG with Docker's substitution (``$VAR``, ``${VAR}``, ``${VAR:-default}``,
``${VAR:+alt}``, quotes and backslashes) against the base image's default environment (PATH as in
the Debian and python images); WORKDIR relative to the previous one; COPY/ADD from the build
context; USER; and RUN steps that need only this host's tools, kept in order with the ENV, ARG
and WORKDIR in effect at that line, to run as setup commands before the agent. A RUN that only
installs apt packages this host already has is satisfied by the host's (`apt_only`). Whatever needs an
image of its own -- a package manager or the network in a RUN, a tool this host lacks, a second
stage, a non-root USER, a write into the system folders -- becomes a reason, and the task is routed
to a container with it.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
import shutil
from dataclasses import dataclass, field

# The base images' default environment (Debian and python:* images; Terminal-Bench's bases derive from them).
BASE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
HOST_PATH = BASE_ENV["PATH"]
#: Instructions with no effect on a running sandbox.
INERT = frozenset({"LABEL", "MAINTAINER", "CMD", "ENTRYPOINT", "EXPOSE", "VOLUME", "HEALTHCHECK", "STOPSIGNAL"})
#: RUN commands that install software or reach the network: they need the task's own image.
NEEDS_IMAGE = frozenset({
    "apt-get", "apt", "aptitude", "apk", "yum", "dnf", "microdnf", "zypper", "pacman", "dpkg", "snap", "brew",
    "pip", "pip3", "pipx", "uv", "uvx", "poetry", "conda", "mamba", "micromamba", "npm", "npx", "yarn", "pnpm",
    "bun", "gem", "bundle", "cargo", "rustup", "cpan", "cpanm", "composer", "curl", "wget", "add-apt-repository",
    "apt-key", "nvm", "sdk", "install.packages", "go",
})
#: RUN commands that change the system's users or configuration (a read-only /etc and one uid locally).
SYSTEM_ADMIN = frozenset({
    "useradd", "adduser", "groupadd", "addgroup", "usermod", "userdel", "chpasswd", "passwd", "visudo",
    "locale-gen", "update-locale", "ldconfig", "update-alternatives", "update-ca-certificates", "systemctl",
    "service", "sysctl", "mount",
})
SHELL_WORDS = frozenset({
    "cd", "export", "echo", "set", "unset", "true", "false", "test", "[", "[[", "]]", "]", "if", "then", "fi",
    "else", "elif", "for", "while", "until", "do", "done", "case", "esac", "in", "{", "}", "!", "source", ".",
    "printf", "read", "umask", "ulimit", "exec", "exit", "return", "local", "shift", "trap", "wait", "eval",
    "alias", "type", "command", "hash", "pwd", "let", "declare", "function", "time", "sudo", "env", "nohup",
})
OPERATORS = frozenset({";", "&&", "||", "|", "&", "(", ")", ";;", "|&", "\n"})
WRITERS = frozenset({"mkdir", "touch", "tee", "rm", "ln", "cp", "mv", "install", "chmod", "rmdir"})
SYSTEM_PREFIX = re.compile(r"^/(usr|etc|bin|sbin|lib\w*|proc|sys|dev)(/|$)")
TOOLCHAIN_IMAGES = {"node": "node", "golang": "go", "rust": "cargo", "openjdk": "java", "eclipse-temurin": "java",
                    "maven": "mvn", "gradle": "gradle", "ruby": "ruby", "php": "php", "perl": "perl",
                    "julia": "julia", "r-base": "R", "rocker": "R", "dotnet": "dotnet", "swift": "swift",
                    "elixir": "elixir", "haskell": "ghc", "erlang": "erl", "gcc": "gcc", "clojure": "clojure"}


@dataclass(frozen=True)
class SetupStep:
    """A RUN line to run in the local sandbox before the agent: its shell command, cwd and environment."""

    command: str
    workdir: str
    env: dict[str, str]
    line: str  # as the Dockerfile has it, for messages


@dataclass
class DockerPlan:
    image: str | None = None  # FROM
    workdir: str | None = None  # the final WORKDIR
    env: dict[str, str] = field(default_factory=dict)  # every ENV, expanded (``${PATH}``: the base image's)
    copies: list[tuple[str, str]] = field(default_factory=list)  # (context-relative source, absolute dest)
    steps: list[SetupStep] = field(default_factory=list)
    workdirs: list[str] = field(default_factory=list)  # each WORKDIR Docker would create
    user: str | None = None
    reasons: list[str] = field(default_factory=list)
    host_packages: list[str] = field(default_factory=list)  # apt packages a RUN installs that this host has
    made_dirs: set[str] = field(default_factory=set)  # folders RUN steps create with mkdir (for COPY's target)


# -- Docker's word processing ----------------------------------------------------------------------

def expand(text: str, env: dict[str, str], *, split: bool = False) -> list[str]:
    """Docker's substitution and quote removal for ENV, ARG, WORKDIR, COPY, USER ... arguments.

    ``split``: break into words at unquoted whitespace (ENV's ``a=1 b=2``); else one word."""
    words: list[str] = []
    cur: list[str] = []
    have = False  # a word was started (so '' counts)
    i, quote = 0, None
    while i < len(text):
        c = text[i]
        if quote == "'":
            if c == "'":
                quote = None
            else:
                cur.append(c)
            i += 1
        elif c == "\\" and i + 1 < len(text) and (quote is None or text[i + 1] in '"\\$'):
            cur.append(text[i + 1])
            have, i = True, i + 2
        elif c in "'\"" and (quote is None or c == quote):
            quote = None if quote else c
            have, i = True, i + 1
        elif c == "$":
            value, i = _dollar(text, i, env)
            cur.append(value)
            have = True
        elif split and quote is None and c.isspace():
            if have or cur:
                words.append("".join(cur))
            cur, have, i = [], False, i + 1
        else:
            cur.append(c)
            have, i = True, i + 1
    if have or cur or not split:
        words.append("".join(cur))
    return words


def expand_one(text: str, env: dict[str, str]) -> str:
    return expand(text, env)[0]


def _dollar(text: str, i: int, env: dict[str, str]) -> tuple[str, int]:
    """The value of the ``$`` expression at ``text[i]`` and the index after it."""
    if i + 1 < len(text) and text[i + 1] == "{":
        depth, j = 1, i + 2
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        body = text[i + 2:j - 1]
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-+])(.*))?", body, re.DOTALL)
        if not m:
            return text[i:j], j
        name, op, word = m.group(1), m.group(2), m.group(3) or ""
        value = env.get(name)
        if op is None:
            return value or "", j
        unset = value is None or (op.startswith(":") and value == "")
        if op.endswith("-"):
            return (expand_one(word, env) if unset else value or ""), j
        return ("" if unset else expand_one(word, env)), j
    m = re.match(r"[A-Za-z_][A-Za-z0-9_]*", text[i + 1:])
    if not m:
        return "$", i + 1
    return env.get(m.group(0), ""), i + 1 + m.end()


# -- the Dockerfile ---------------------------------------------------------------------------------

def dockerfile_lines(text: str) -> list[str]:
    """Instructions with line continuations joined and comments dropped."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments inside a continued instruction are dropped as well, as Docker does
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending.strip():
        out.append(pending)
    return out


def _exec_form(args: str) -> list[str] | None:
    if args.lstrip().startswith("["):
        try:
            value = json.loads(args)
        except json.JSONDecodeError:
            return None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    return None


def plan_dockerfile(text: str, *, base_env: dict[str, str] | None = None) -> DockerPlan:
    """Read a Dockerfile as a recipe for the local sandbox; anything it cannot honour becomes a reason."""
    plan = DockerPlan()
    env: dict[str, str] = {}  # ENV so far (what the image keeps)
    args: dict[str, str] = {}  # ARG so far (build time only: RUN sees them, the image does not)
    shell = ["/bin/sh", "-c"]
    workdir = "/"
    stages = 0
    for line in dockerfile_lines(text):
        word, _, rest = line.partition(" ")
        op, rest = word.upper(), rest.strip()
        scope = {**BASE_ENV, **(base_env or {}), **args, **env}
        if op == "FROM":
            stages += 1
            if stages > 1:
                plan.reasons.append("its Dockerfile has several stages (a second FROM)")
                break
            parts = [p for p in expand(rest, scope, split=True) if not p.startswith("--")]
            plan.image = parts[0] if parts else None
            _check_base_image(plan)
        elif op == "ARG":
            for item in expand(rest, scope, split=True):
                name, eq, default = item.partition("=")
                args[name] = default if eq else args.get(name, "")
        elif op == "ENV":
            env.update(_parse_env(rest, scope))
        elif op == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, expand_one(rest, scope)))
            plan.workdirs.append(workdir)
        elif op == "USER":
            plan.user = expand_one(rest, scope).strip()
            if plan.user not in ("root", "0", "root:root", "0:0"):
                plan.reasons.append(f"it runs as user {plan.user!r} (the local sandbox has only root)")
        elif op in ("COPY", "ADD"):
            _plan_copy(plan, op, rest, scope, workdir)
        elif op == "SHELL":
            shell = _exec_form(rest) or shell
        elif op == "RUN":
            _plan_run(plan, line, rest, shell, workdir, {**args, **env})
        elif op == "ONBUILD":
            continue
        elif op not in INERT:
            plan.reasons.append(f"its Dockerfile has `{line[:60]}`")
    plan.workdir = workdir if plan.workdirs else None
    plan.env = env
    return plan


def _parse_env(rest: str, scope: dict[str, str]) -> dict[str, str]:
    """``ENV a=1 b="x y"`` or the legacy ``ENV NAME value with spaces``; every substitution in one
    instruction sees the values from before it, as in Docker."""
    first = rest.split(None, 1)
    if first and "=" not in first[0]:
        return {first[0]: expand_one(first[1], scope) if len(first) > 1 else ""}
    out = {}
    for item in expand(rest, scope, split=True):
        name, eq, value = item.partition("=")
        if eq:
            out[name] = value
    return out


def _check_base_image(plan: DockerPlan) -> None:
    """A base image that brings a toolchain (node, go, java ...) this host lacks needs that image."""
    if not plan.image or plan.image == "scratch":
        plan.reasons.append("its Dockerfile starts FROM scratch")
        return
    repo = plan.image.split("@")[0].rsplit("/", 1)[-1].split(":")[0]
    tool = TOOLCHAIN_IMAGES.get(repo)
    if tool and not shutil.which(tool, path=HOST_PATH):
        plan.reasons.append(f"its base image {plan.image} provides `{tool}`, which this host lacks")


def _plan_copy(plan: DockerPlan, op: str, rest: str, scope: dict[str, str], workdir: str) -> None:
    form = _exec_form(rest)
    parts = form if form is not None else expand(rest, scope, split=True)
    flags = [p for p in parts if p.startswith("--")]
    parts = [p for p in parts if not p.startswith("--")]
    if len(parts) < 2 or any(f.startswith("--from") for f in flags) or "://" in rest:
        plan.reasons.append(f"its Dockerfile copies from outside the build context (`{rest[:60]}`)")
        return
    *sources, dest = parts
    if op == "ADD" and any(re.search(r"\.(tar|tgz|tar\.\w+|txz|tbz2?)$", s) for s in sources):
        plan.reasons.append(f"its Dockerfile ADDs an archive, which Docker unpacks (`{rest[:60]}`)")
        return
    dest = posixpath.normpath(posixpath.join(workdir, dest)) + ("/" if dest.endswith("/") else "")
    # Into a folder also where one exists at that line: a WORKDIR, or one a RUN made (`mkdir -p /app`).
    into_dir = dest.endswith("/") or len(sources) > 1 or dest in plan.workdirs or dest in plan.made_dirs
    dest = dest.rstrip("/") or "/"
    if SYSTEM_PREFIX.match(dest):
        plan.reasons.append(f"its Dockerfile copies into {dest} (a read-only system folder in the local sandbox)")
        return
    for src in sources:
        plan.copies.append((src, dest + "/" if into_dir and dest != "/" else dest))


def _plan_run(plan: DockerPlan, line: str, rest: str, shell: list[str], workdir: str, env: dict[str, str]) -> None:
    form = _exec_form(rest)
    if form is not None:
        command = shlex.join(form)
    elif rest.startswith("--"):
        plan.reasons.append(f"its Dockerfile has a RUN with BuildKit options (`{line[:60]}`)")
        return
    elif "<<" in rest.split("\n", 1)[0] and re.match(r"<<-?\s*['\"]?\w+", rest):
        plan.reasons.append(f"its Dockerfile has a RUN heredoc (`{line[:60]}`)")
        return
    else:
        command = rest
    apt = apt_only(command)
    if apt is not None:  # `apt-get update && apt-get install -y X && rm -rf /var/lib/apt/lists/*`
        missing = [p for p in apt if not host_has_package(p)]
        if missing:
            plan.reasons.append(f"its Dockerfile's `{line[:70]}` installs apt packages this host lacks "
                                f"({', '.join(missing)})")
        else:
            plan.host_packages += apt
        return
    reason = run_reason(command)
    if reason:
        plan.reasons.append(f"its Dockerfile's `{line[:70]}` {reason}")
        return
    for made in re.findall(r"\bmkdir\s+(?:-\S+\s+)*([^\s;&|]+(?:\s+[^\s;&|-][^\s;&|]*)*)", command):
        plan.made_dirs |= {posixpath.normpath(posixpath.join(workdir, d)) for d in made.split()}
    script = command if form is not None else shlex.join([*shell, command])
    plan.steps.append(SetupStep(command=script, workdir=workdir, env=dict(env), line=line))


def run_reason(command: str) -> str | None:
    """Why a RUN command cannot run in the local sandbox (None: it needs only this host's tools)."""
    try:
        lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError:
        return "is not a shell command this reader can follow"
    expect_cmd, prev = True, ""
    for k, tok in enumerate(tokens):
        if tok in OPERATORS or set(tok) <= set(";&|()"):
            expect_cmd, prev = True, tok
            continue
        if prev in (">", ">>", ">|", "&>") and SYSTEM_PREFIX.match(tok) and not tok.startswith("/dev/null"):
            return f"writes into {tok} (read-only in the local sandbox)"
        prev = tok
        if not expect_cmd:
            continue
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tok) or tok in ("sudo", "env", "time", "nohup", "!"):
            continue
        name = posixpath.basename(tok)
        args = _args(tokens, k + 1)
        if name in NEEDS_IMAGE and not (name == "go" and not {"install", "get", "mod"} & set(args)):
            return f"needs a package manager or the network (`{name}`)"
        if name == "git" and {"clone", "fetch", "pull", "submodule", "ls-remote"} & set(args):
            return "needs the network (`git " + next(a for a in args if a in ("clone", "fetch", "pull",
                                                                               "submodule", "ls-remote")) + "`)"
        if re.fullmatch(r"python[0-9.]*", name) and "-m" in args and args[args.index("-m") + 1:][:1] in (
                ["pip"], ["ensurepip"], ["pipx"], ["uv"]):
            return f"needs a package manager or the network (`{name} -m {args[args.index('-m') + 1]}`)"
        if name in SYSTEM_ADMIN:
            return f"changes the system's users or configuration (`{name}`)"
        if name in ("chown", "chgrp"):
            owner = next((a for a in args if not a.startswith("-")), "")
            if owner.split(":")[0] not in ("root", "0", ""):
                return f"changes file ownership to {owner} (the local sandbox has one uid)"
        if name in WRITERS:
            target = next((a for a in args if SYSTEM_PREFIX.match(a)), None)
            if target and not (name in ("cp", "ln", "install") and target != args[-1]):
                return f"writes into {target} (read-only in the local sandbox)"
        if name == "sed" and "-i" in args:
            target = next((a for a in args if SYSTEM_PREFIX.match(a)), None)
            if target:
                return f"writes into {target} (read-only in the local sandbox)"
        if "/" not in tok and name not in SHELL_WORDS and not shutil.which(name, path=HOST_PATH):
            return f"needs `{name}`, which this host lacks"
        expect_cmd = tok in ("xargs", "exec", "if", "then", "do", "else", "elif", "while", "until", "{")
    return None


APT_NOOPS = {"update", "clean", "autoclean", "autoremove"}


def apt_only(command: str) -> list[str] | None:
    """The packages of a RUN made only of apt-get/apt update, install and cleanup (None: it does more).
    Such a step is satisfied locally when this host has every package (`host_has_package`)."""
    try:
        lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError:
        return None
    packages: list[str] = []
    segments: list[list[str]] = [[]]
    for tok in tokens:
        if tok in ("&&", ";", "\n"):
            segments.append([])
        elif tok in OPERATORS or set(tok) <= set(";&|()<>"):
            return None
        else:
            segments[-1].append(tok)
    for seg in (s for s in segments if s):
        words = [w for w in seg if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", w)]
        if words[:1] in (["apt-get"], ["apt"]):
            sub = next((w for w in words[1:] if not w.startswith("-")), "")
            if sub == "install":
                packages += [w.split("=")[0] for w in words[words.index("install") + 1:] if not w.startswith("-")]
            elif sub not in APT_NOOPS:
                return None
        elif words[:2] == ["rm", "-rf"] and all(w.startswith("/var/lib/apt/lists") or w.startswith("/var/cache/apt")
                                                 for w in words[2:]):
            continue
        else:
            return None
    return packages if packages else None


def host_has_package(name: str) -> bool:
    """Whether this (Debian-family) host has the apt package ``name`` installed."""
    dpkg = shutil.which("dpkg-query", path=HOST_PATH)
    if not dpkg or not re.fullmatch(r"[a-z0-9][a-z0-9+.:-]*", name):
        return False
    import subprocess

    out = subprocess.run([dpkg, "-W", "-f=${Status}", name], capture_output=True, text=True, timeout=30)
    return out.returncode == 0 and out.stdout.strip().endswith("installed") and "not-installed" not in out.stdout


def _args(tokens: list[str], start: int) -> list[str]:
    out = []
    for tok in tokens[start:]:
        if tok in OPERATORS or set(tok) <= set(";&|()<>"):
            break
        out.append(tok)
    return out


# -- compose -----------------------------------------------------------------------------------------

@dataclass
class ComposeService:
    """The one service of a task's docker-compose.yaml, as far as it shapes the sandbox."""

    name: str
    context: str | None = None  # environment/-relative build context
    dockerfile: str = "Dockerfile"
    image: str | None = None  # a prebuilt image (when there is no build)
    env: dict[str, str] = field(default_factory=dict)
    working_dir: str | None = None
    network: bool | None = None  # None: not said
    cpus: float | None = None
    reasons: list[str] = field(default_factory=list)


COMPOSE_VARS = {"CONTEXT_DIR": ".", "TEST_DIR": "/tests"}  # what Harbor's own compose files are given


def read_compose(text: str, where: str) -> ComposeService:
    """A compose file with one service (Harbor's ``main``); several services become a reason."""
    import yaml

    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        svc = ComposeService("?")
        svc.reasons.append(f"its {where} is not valid YAML ({str(e).splitlines()[0]})")
        return svc
    services = data.get("services") if isinstance(data, dict) else None
    if not isinstance(services, dict) or not services:
        svc = ComposeService("?")
        svc.reasons.append(f"its {where} names no services")
        return svc
    if len(services) > 1:
        svc = ComposeService(",".join(services))
        svc.reasons.append(f"it starts {len(services)} services ({', '.join(services)}) from {where}")
        return svc
    name, body = next(iter(services.items()))
    body = body if isinstance(body, dict) else {}
    svc = ComposeService(str(name))
    sub = lambda v: expand_one(str(v), {**COMPOSE_VARS, **os.environ}) if v is not None else None  # noqa: E731
    build = body.get("build")
    if isinstance(build, str):
        svc.context = sub(build)
    elif isinstance(build, dict):
        svc.context = sub(build.get("context", "."))
        svc.dockerfile = sub(build.get("dockerfile", "Dockerfile")) or "Dockerfile"
    if build is None and body.get("image"):
        svc.image = sub(body["image"])
    environment = body.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(str(e).partition("=")[::2] for e in environment)
    svc.env = {str(k): sub(v) or "" for k, v in environment.items()}
    svc.working_dir = sub(body.get("working_dir")) or None
    mode = body.get("network_mode")
    if mode is not None:
        svc.network = str(mode) != "none"
    cpus = body.get("cpus") or (((body.get("deploy") or {}).get("resources") or {}).get("limits") or {}).get("cpus")
    try:
        svc.cpus = float(cpus) if cpus is not None else None
    except (TypeError, ValueError):
        svc.cpus = None
    for key in ("privileged", "cap_add", "devices", "ports", "sysctls"):
        if body.get(key):
            svc.reasons.append(f"its service {name} sets `{key}` in {where}")
    volumes = [v for v in body.get("volumes") or [] if not re.search(r"\$\{?(HOST|ENV)_", str(v))]
    if volumes:
        svc.reasons.append(f"its service {name} mounts volumes ({volumes[0]}) in {where}")
    return svc
