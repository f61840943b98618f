"""The resume proof's wrapper of ``torch.distributed.checkpoint.save`` (the call of
``save_checkpoint``'s ``fsdp_dtensor`` / ``torch_dcp`` formats): the pending state digest is in the
iteration directory before DCP writes anything, so no crash leaves a complete checkpoint (DCP's
``.metadata``) that its load cannot prove. Before, the digest followed upstream's tracker write;
the crash-point sweep (``docs/crash-points.md``) found restarts resuming such a checkpoint
unproven."""

from __future__ import annotations

from types import SimpleNamespace

from megatron.training_ext.resume_proof import hooks


def _setup(monkeypatch, state):
    order = []
    monkeypatch.setattr(hooks, "proof_state", lambda: state)
    monkeypatch.setattr(hooks, "process_rank", lambda: 0)
    monkeypatch.setattr(
        hooks.digest_record, "write_record", lambda d, rec: order.append(("digest", str(d), rec))
    )

    def dcp_save(state_dict=None, storage_writer=None, **kw):
        order.append(("dcp", str(storage_writer.path)))
        return "saved"

    return order, hooks._wrap_dcp_save(dcp_save)


def test_pending_digest_is_written_before_the_dcp_save(tmp_path, monkeypatch):
    d = tmp_path / "iter_0000004"
    d.mkdir()
    state = SimpleNamespace(pending={"n": 1}, written=False)
    order, save = _setup(monkeypatch, state)
    assert save(state_dict={}, storage_writer=SimpleNamespace(path=d)) == "saved"
    assert order == [("digest", str(d), {"n": 1}), ("dcp", str(d))] and state.written


def test_no_digest_without_a_pending_one_or_outside_an_iteration_directory(tmp_path, monkeypatch):
    other = tmp_path / "modelopt_state"
    other.mkdir()
    order, save = _setup(monkeypatch, SimpleNamespace(pending={"n": 1}, written=False))
    save(state_dict={}, storage_writer=SimpleNamespace(path=other))
    assert order == [("dcp", str(other))]
    d = tmp_path / "iter_0000002"
    d.mkdir()
    order, save = _setup(monkeypatch, SimpleNamespace(pending=None, written=False))
    save(state_dict={}, storage_writer=SimpleNamespace(path=d))
    assert order == [("dcp", str(d))]
    order, save = _setup(monkeypatch, None)  # the proof not installed (or --resume-proof off)
    save(state_dict={}, storage_writer=SimpleNamespace(path=d))
    assert order == [("dcp", str(d))]
