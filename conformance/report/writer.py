"""The conformance report as a versioned, schema-checked document, and its JUnit XML form.

- ``metadata(...)`` adds what a CI needs to keep a report: report-format, spec and suite versions, the SPEC.md
  hash, the platform (OS, CPU, Python, MLX version, device), dtype, profile, seed and start time (the IUT and
  its declared capabilities are ``implementation``, from adapter.describe).
- ``report.schema.json`` (shipped in the package) is the JSON Schema of the report; ``validate_report`` checks a
  report against it with ``validate``, a small validator for the subset of JSON Schema the file uses
  (type, properties, required, additionalProperties, items, enum, pattern, minimum, $ref to #/$defs). jsonschema
  is not a dependency: the subset is 60 lines and the schema is ours.
- ``write_junit`` writes one ``<testcase>`` per clause (fail/timeout/crash: ``<failure>``; interrupted:
  ``<error>``; not-implemented, not-applicable, untested, xfail: ``<skipped>``).
"""

from __future__ import annotations

import datetime
from importlib.metadata import PackageNotFoundError, version
import json
import os
import platform
import re
import xml.etree.ElementTree as ET
from importlib import resources

from a2ats_spec.clauses import CLAUSES, SPEC_VERSION, spec_sha256

from a2ats_conformance.report.versions import REPORT_FORMAT, suite_version

__all__ = ["SCHEMA", "metadata", "platform_info", "validate", "validate_report", "write_junit", "junit_xml"]

SCHEMA: dict = json.loads(resources.files("a2ats_conformance").joinpath("report.schema.json").read_text("utf-8"))

_FAILURE = ("fail", "timeout", "crash")
_SKIPPED = ("not-implemented", "not-applicable", "untested", "xfail")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mlx() -> tuple[str | None, dict]:
    """MLX's version and default device, or (None, the CPU) when MLX is not installed or cannot be imported
    (a port's environment, grading answers): the suite runs without the reference's framework."""

    try:
        v = version("mlx")
    except PackageNotFoundError:
        return None, {"type": "cpu", "name": _cpu_name()}
    try:
        # first: a2ats_ref loads the fast BLAS, which must happen before mlx is imported
        import a2ats_ref  # noqa: F401  # deferred: with mlx below
        import mlx.core as mx  # deferred: MLX is the reference's framework, an optional extra of the suite
    except ImportError:
        return None, {"type": "cpu", "name": _cpu_name()}

    dev = mx.default_device()
    kind = "gpu" if dev.type == mx.gpu else "cpu"
    name = _cpu_name()
    if kind == "gpu":
        try:
            name = str(mx.device_info().get("device_name", "gpu"))
        except Exception:  # noqa: BLE001 - an older MLX without device_info
            name = "gpu"
    return v, {"type": kind, "name": name}


def platform_info() -> dict:
    mlx_version, device = _mlx()
    return {"os": platform.platform(), "machine": platform.machine(), "cpu": _cpu_name(),
            "cpu_count": os.cpu_count() or 0, "python": platform.python_version(), "mlx": mlx_version,
            "device": device}


def metadata(*, dtype: str, profile: str, seed, started_at: float) -> dict:
    """The report fields that say what was checked, against which spec, where and when."""

    return {"report_format": REPORT_FORMAT,
            "spec": {"version": SPEC_VERSION, "sha256": spec_sha256()},
            "suite_version": suite_version(),
            "platform": platform_info(),
            "dtype": dtype, "profile": profile, "seed": seed,
            "started_at": datetime.datetime.fromtimestamp(started_at, datetime.timezone.utc).isoformat(timespec="seconds")}


# --------------------------------------------------------------------------- the JSON Schema subset

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is(value, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[t])


def validate(instance, schema: dict, root: dict | None = None, path: str = "$") -> list[str]:
    """Errors of ``instance`` against ``schema`` (the subset named in the module docstring), as 'path: problem'."""
    root = schema if root is None else root
    if "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/$defs/"):
            raise ValueError(f"schema: only '#/$defs/...' references are supported, got {ref!r}")
        return validate(instance, root["$defs"][ref[len("#/$defs/"):]], root, path)
    unknown = set(schema) - {"type", "properties", "required", "additionalProperties", "items", "enum", "pattern",
                             "minimum", "description", "$schema", "$id", "title", "$defs"}
    if unknown:
        raise ValueError(f"schema at {path}: keywords {sorted(unknown)} are outside the supported subset")
    errors: list[str] = []
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is(instance, t) for t in types):
            return [f"{path}: expected {' or '.join(types)}, got {type(instance).__name__} {str(instance)[:60]!r}"]
    if "enum" in schema and instance not in schema["enum"]:
        errors.append(f"{path}: {instance!r} is not one of {schema['enum']}")
    if "pattern" in schema and isinstance(instance, str) and not re.search(schema["pattern"], instance):
        errors.append(f"{path}: {instance!r} does not match {schema['pattern']!r}")
    if "minimum" in schema and _is(instance, "number") and instance < schema["minimum"]:
        errors.append(f"{path}: {instance} < minimum {schema['minimum']}")
    if isinstance(instance, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in instance:
                errors.append(f"{path}: missing required property {key!r}")
        extra = schema.get("additionalProperties", True)
        for key, value in instance.items():
            if key in props:
                errors += validate(value, props[key], root, f"{path}.{key}")
            elif extra is False:
                errors.append(f"{path}: unexpected property {key!r}")
            elif isinstance(extra, dict):
                errors += validate(value, extra, root, f"{path}.{key}")
    if isinstance(instance, list) and "items" in schema:
        for i, value in enumerate(instance):
            errors += validate(value, schema["items"], root, f"{path}[{i}]")
    return errors


def validate_report(report: dict) -> None:
    """ValueError listing every way ``report`` (a dict, or JSON text) departs from report.schema.json."""
    if isinstance(report, str):
        report = json.loads(report)
    errors = validate(json.loads(json.dumps(report, default=str)), SCHEMA)
    if errors:
        raise ValueError(f"report does not match {SCHEMA['$id']}:\n  " + "\n  ".join(errors[:30]))


# --------------------------------------------------------------------------- JUnit XML

def junit_xml(report: dict) -> bytes:
    """JUnit XML (UTF-8 bytes): one <testsuite> with one <testcase> per clause, in SPEC.md order."""

    impl = report.get("implementation", {})
    clauses = report["clauses"]
    count = lambda sts: sum(1 for c in clauses.values() if c["status"] in sts)  # noqa: E731
    suite = ET.Element("testsuite", {
        "name": f"a2ats-conformance {impl.get('name', '?')}", "tests": str(len(clauses)),
        "failures": str(count(_FAILURE)), "errors": str(count(("interrupted",))), "skipped": str(count(_SKIPPED)),
        "time": str(report.get("wall_s", 0)), "timestamp": str(report.get("started_at", ""))})
    props = ET.SubElement(suite, "properties")
    spec = report.get("spec", {})
    for k, v in (("iut", impl.get("iut")), ("implementation", f"{impl.get('name', '')} {impl.get('version', '')}"),
                 ("spec_version", spec.get("version")), ("spec_sha256", spec.get("sha256")),
                 ("suite_version", report.get("suite_version")), ("dtype", report.get("dtype")),
                 ("profile", report.get("profile")), ("seed", report.get("seed"))):
        ET.SubElement(props, "property", {"name": k, "value": "" if v is None else str(v)})
    for cid, c in clauses.items():
        title = CLAUSES[cid].title if cid in CLAUSES else ""
        case = ET.SubElement(suite, "testcase", {"classname": "a2ats.spec", "name": f"{cid} \u2014 {title}".strip(" \u2014"),
                                                 "time": "0"})
        cex = c.get("counterexample") or {}
        if c["status"] in _FAILURE:
            msg = cex.get("message") or c["status"]
            el = ET.SubElement(case, "failure", {"type": c["status"], "message": msg.splitlines()[0][:500]})
            el.text = msg + (f"\nreplay: {cex['repro']}" if cex.get("repro") else "")
        elif c["status"] == "interrupted":
            ET.SubElement(case, "error", {"type": "interrupted", "message": c.get("reason") or "the run stopped"})
        elif c["status"] in _SKIPPED:
            ET.SubElement(case, "skipped", {"message": f"{c['status']}: {c.get('reason') or ''}".strip(": ")})
    return ET.tostring(suite, encoding="utf-8", xml_declaration=True)


def write_junit(report: dict, path: str) -> None:
    with open(path, "wb") as f:
        f.write(junit_xml(report))
