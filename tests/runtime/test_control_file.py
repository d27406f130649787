"""RUN_DIR/control.json as a typed file (flowrl/runtime/controller/control.py): written whole and
private, read back equal, and a missing or garbled one is an error naming the file — which
`flowrl scale` reports as its refusal (flowrl/runtime/controller/scaling.py)."""

import stat

import pytest

from flowrl.runtime.controller.control import ControlFile, ControlFileError
from flowrl.runtime.controller.scaling import ScaleError, request


def test_a_control_file_reads_back_as_written_and_only_its_owner_can_read_it(tmp_path):
    c = ControlFile(address="ipc:///tmp/x/control", secret="ab12", pid=4242)
    path = c.write(tmp_path)
    assert ControlFile.read(tmp_path) == c
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["control.json"], "no temporary file left"


@pytest.mark.parametrize("text, why", [
    ("{\"address\": \"ipc://x\", \"secr", "is garbled (not JSON"),
    ("[1, 2]", "a JSON object was expected, got list"),
    ('{"address": "ipc://x", "secret": 7, "pid": 1}', "'secret' must be str"),
    ('{"address": "ipc://x", "secret": "s"}', "'pid' must be int"),
    ('{"address": "ipc://x", "secret": "s", "pid": true}', "'pid' must be int"),
])
def test_a_garbled_control_file_is_an_error_naming_the_file_and_what_is_wrong(tmp_path, text, why):
    (tmp_path / "control.json").write_text(text)
    with pytest.raises(ControlFileError) as e:
        ControlFile.read(tmp_path)
    assert str(e.value).startswith(str(tmp_path / "control.json")) and why in str(e.value)
    with pytest.raises(ScaleError, match="control.json is garbled"):
        request(tmp_path, "rollout", 2, timeout_s=0.1)


def test_a_missing_control_file_says_the_run_may_be_over(tmp_path):
    with pytest.raises(ScaleError) as e:
        request(tmp_path, "rollout", 2, timeout_s=0.1)
    # the chaos scaler retries on this wording while a run starts (flowrl/testing/chaos/trial.py)
    assert str(e.value) == f"{tmp_path / 'control.json'} is missing or unreadable: is the run still going?"
