"""What a machine file was measured on (dbs_mpi/tools/fingerprint.py): the record, the
fingerprint that names this machine's file, the default file, and the one line a replay
prints when its file was measured elsewhere. No timing."""
import json
import shutil

import pytest

from conftest import ROOT, run_cli
from dbs_mpi.tools.fingerprint import FALLBACK, describe, elsewhere_note, fingerprint, machine_file
from dbs_mpi.tools.machine import Machine

HOST = {"cpu": "Intel(R) Xeon(R) Processor @ 2.50GHz", "cpus": 2, "threads_per_core": 1, "memory_gib": 23.5,
        "torch": "2.13.0+cpu", "mpi": "MPICH Version: 5.0.2", "host": "vm", "date": "2026-11-28 11:00"}
RUN = ROOT / "results" / "validation" / "ssgd-2r.h5"


def test_this_host_is_described_with_what_a_machine_file_records():
    here = describe("MPICH 5")
    assert set(here) == set(HOST) and here["mpi"] == "MPICH 5", here
    assert here["cpu"] and here["cpus"] >= 1 and here["threads_per_core"] >= 1 and here["memory_gib"] > 0, here
    assert fingerprint(here) == fingerprint(describe())        # the same host, whatever the MPI


def test_the_fingerprint_is_the_hardware_only():
    assert fingerprint(HOST) == "intel-xeon-processor-2-50ghz-2cpu-1tpc-24gib"
    software = {**HOST, "torch": "2.0", "mpi": "Open MPI 5", "host": "other", "date": "2027-01-01 00:00"}
    assert fingerprint(software) == fingerprint(HOST)
    for change in ({"cpu": "AMD EPYC 7763 64-Core Processor"}, {"cpus": 4}, {"threads_per_core": 2},
                   {"memory_gib": 64.0}):
        assert fingerprint({**HOST, **change}) != fingerprint(HOST), change
    assert fingerprint({}) == ""


def test_the_default_machine_file_is_this_machines_once_calibrated(tmp_path):
    shutil.copy(FALLBACK, tmp_path / FALLBACK.name)
    assert machine_file(tmp_path, HOST) == tmp_path / "dev-2core.json"
    own = tmp_path / f"{fingerprint(HOST)}.json"
    shutil.copy(FALLBACK, own)
    assert machine_file(tmp_path, HOST) == own
    assert machine_file(tmp_path, {**HOST, "cpus": 8}) == tmp_path / "dev-2core.json"


def test_a_file_measured_elsewhere_says_so_in_one_line_with_the_command():
    assert elsewhere_note(HOST, "m.json", {**HOST, "date": "later", "torch": "2.14"}) == ""
    other = elsewhere_note({**HOST, "cpu": "AMD EPYC 7763"}, "m.json", HOST)
    unknown = elsewhere_note({}, "m.json", HOST)
    for note in (other, unknown):
        assert "\n" not in note and note.startswith("machine: m.json was measured on "), note
        assert "`mpirun -n 2 dbs-mpi simulate calibrate`" in note and f"{fingerprint(HOST)}.json" in note, note
    assert "another machine (AMD EPYC 7763" in other and "does not record" in unknown


def test_a_machine_file_keeps_its_host_and_compute_extra(tmp_path):
    machine = Machine.load(FALLBACK)
    assert machine.host == {} and machine.compute_extra == {}        # measured before they were recorded
    machine.host, machine.compute_extra = HOST, {"spinning": 0.003, "sleeping": 0.006}
    machine.save(tmp_path / "m.json")
    again = Machine.load(tmp_path / "m.json")
    assert again.host == HOST and again.compute_extra == machine.compute_extra


@pytest.mark.parametrize("same", [True, False])
def test_a_replay_names_a_machine_file_measured_on_another_machine(tmp_path, same):
    machine = Machine.load(FALLBACK)
    machine.host = describe() if same else {**describe(), "cpu": "Some Other CPU 9000"}
    machine.save(tmp_path / "m.json")
    run = run_cli(["simulate", "--from", str(RUN), "--machine", str(tmp_path / "m.json"), "--json"], timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["machine"] == str(tmp_path / "m.json")
    if same:
        assert "machine_note" not in out and "measured on" not in run.stderr, run.stderr
    else:
        assert out["machine_note"] in run.stderr.splitlines(), run.stderr
        assert "another machine (Some Other CPU 9000" in out["machine_note"]
    text = run_cli(["simulate", "--from", str(RUN), "--machine", str(tmp_path / "m.json")], timeout=120)
    assert text.returncode == 0 and (("another machine" in text.stdout) != same), text.stdout
