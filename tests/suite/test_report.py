"""The suite's own report: versions, platform and start time recorded; JSON schema; JUnit XML per clause."""

import json
import xml.etree.ElementTree as ET

from a2ats_conformance.run.cli import main
from a2ats_conformance.report.writer import validate_report
from a2ats_spec.clauses import SPEC_VERSION, spec_sha256


def test_suite_report_records_versions_platform_and_junit(tmp_path):
    js, xml = tmp_path / "r.json", tmp_path / "r.xml"
    code = main(["--iut", "a2ats_conformance.mutants:WindowOffByOne", "--profile", "selftest", "--seed", "0", "-q",
                 "--clauses", "EQ-11,RET-TOPK", "--report-json", str(js), "--junit-xml", str(xml)])
    assert code == 1
    report = json.loads(js.read_text())
    validate_report(report)
    assert report["spec"] == {"version": SPEC_VERSION, "sha256": spec_sha256()}
    assert report["report_format"] == "a2ats-conformance-report/1" and report["suite_version"]
    assert report["platform"]["device"]["type"] in ("cpu", "gpu") and report["platform"]["mlx"]
    assert report["dtype"] == "float32" and report["profile"] == "selftest" and report["seed"] == 0
    assert report["implementation"]["capabilities"]["cache_ops"]
    suite = ET.parse(xml).getroot()
    cases = {c.get("name").split(" ")[0]: c for c in suite.iter("testcase")}
    assert list(cases) == list(report["clauses"]) == ["EQ-11", "RET-TOPK"]
    assert cases["EQ-11"].find("failure") is not None and cases["RET-TOPK"].find("failure") is None
    assert suite.get("failures") == "1" and suite.get("tests") == "2"
