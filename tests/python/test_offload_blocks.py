"""Offload blocks: defaults from the configuration, and nesting (each save follows the block it
was saved in; an inner block gives the enclosing block's settings back when it ends)."""

import threading

import pytest
import torch

import spillway
import test_environment
from conftest import run_script, stat


def saves_one(x):
    """A forward that saves one storage of x's size that only autograd holds (exp's output)."""
    return (x * 2).exp().sum()


def spills_during(fn):
    before = stat("spillway.num_spills")
    fn()
    return stat("spillway.num_spills") - before


def test_an_inner_block_gives_the_outer_policy_back():
    x = torch.randn(1024, 1024, requires_grad=True)
    losses = []

    def outer_off():
        with spillway.offload("off"):
            with spillway.offload("eager"):
                pass
            losses.append(saves_one(x))  # under "off" again

    def outer_eager():
        with spillway.offload("eager"):
            with spillway.offload("off"):
                pass
            losses.append(saves_one(x))  # under "eager" again

    assert spills_during(outer_off) == 0
    assert spills_during(outer_eager) == 1
    for loss in losses:
        loss.backward()


def test_saves_made_in_an_inner_off_block_stay_on_the_device():
    x = torch.randn(1024, 1024, requires_grad=True)
    expected = 2 * (x.detach() * 2).exp() * 2  # d/dx of both terms below

    def forward():
        with spillway.offload("eager"):
            with spillway.offload("off"):
                kept = saves_one(x)
            spilled = saves_one(x)
        (kept + spilled).backward()

    assert spills_during(forward) == 1  # only the outer block's save
    assert torch.equal(x.grad, expected)


def test_a_block_without_arguments_takes_the_configured_policy_and_minimum():
    out = run_script("""
        import torch, spillway
        spillway.install("sim", capacity_bytes=256 << 20, conf="offload:eager,offload_min_kb:4096")
        x = torch.randn(512, 1024, requires_grad=True)   # 2 MiB: below offload_min_kb
        y = torch.randn(2048, 1024, requires_grad=True)  # 8 MiB
        with spillway.offload():
            loss = (x * 2).exp().sum() + (y * 2).exp().sum()
        print("spills", spillway.memory_stats()["spillway.num_spills"])
        loss.backward()
    """)
    assert out.returncode == 0, out.stderr
    assert "spills 1" in out.stdout, out.stdout


@pytest.mark.skipif(test_environment.SITE is None, reason="SPILLWAY_PYTHON_SITE not set")
def test_a_block_under_the_environment_hook_gives_process_wide_offload_back():
    out = test_environment.run_script("""
        import torch, spillway
        x = torch.randn(1024, 1024, requires_grad=True)
        with spillway.offload("off"):
            a = (x * 2).exp().sum()
        before = spillway.memory_stats()["spillway.num_spills"]
        b = (x * 3).exp().sum()  # outside any block: process-wide eager offload again
        c = (x * 4).exp().sum()  # (eager spills b at this save)
        print("spills after the block", spillway.memory_stats()["spillway.num_spills"] - before)
        (a + b + c).backward()
    """, env={"PYTHONUSERBASE": test_environment.SITE,
              "SPILLWAY_ALLOC_CONF": "device:sim,capacity_mb:256,offload:eager,offload_min_kb:0"})
    assert out.returncode == 0, out.stderr
    assert "spills after the block" in out.stdout, out.stdout
    assert "spills after the block 0" not in out.stdout, out.stdout


@pytest.mark.parametrize("theirs", [dict(policy="off"), dict(policy="eager", min_bytes=1 << 40)],
                         ids=["off", "min_bytes"])
def test_a_save_follows_the_block_of_its_own_thread(theirs):
    """Two threads in blocks at once: each save keeps the "off" and min_bytes of its own thread's
    block, not those of the block another thread entered last (which the engine holds). The
    other thread enters its block first, this one its "eager" block last; then the other thread
    saves (its save stays on the device), and this one (its save is spilled)."""
    x = torch.randn(1024, 1024, requires_grad=True)
    losses = []
    entered, go_on, saved, finish = (threading.Event() for _ in range(4))

    def other_thread():
        with spillway.offload(**theirs):
            entered.set()
            go_on.wait(timeout=60)
            losses.append(saves_one(x))
            saved.set()
            finish.wait(timeout=60)

    def forward():
        thread = threading.Thread(target=other_thread)
        thread.start()
        try:
            assert entered.wait(timeout=60), "the other thread never entered its block"
            # min_bytes leaves out the other save of saves_one, the 0-dim tensor that x * 2 saves.
            with spillway.offload("eager", min_bytes=1 << 20):
                go_on.set()
                assert saved.wait(timeout=60), "the other thread never saved"
                losses.append(saves_one(x))
                finish.set()
                thread.join()
        finally:
            go_on.set()
            finish.set()
            thread.join()

    try:
        assert spills_during(forward) == 1
    finally:
        with spillway.offload():  # the configured settings again, for the tests after this one
            pass
    assert len(losses) == 2
    (losses[0] + losses[1]).backward()
    assert torch.equal(x.grad, 2 * 2 * (x.detach() * 2).exp())


@pytest.mark.skipif(test_environment.SITE is None, reason="SPILLWAY_PYTHON_SITE not set")
def test_saves_outside_blocks_follow_the_environment_hook_while_a_thread_is_in_a_block():
    """Under the environment hook, a save outside any block keeps the process-wide settings even
    while another thread's block has set the engine's (min_bytes far above the save here)."""
    out = test_environment.run_script("""
        import threading, torch, spillway
        x = torch.randn(1024, 1024, requires_grad=True)
        entered, finish = threading.Event(), threading.Event()
        def other_thread():
            with spillway.offload("eager", min_bytes=1 << 40):
                entered.set()
                finish.wait(timeout=60)
        thread = threading.Thread(target=other_thread)
        thread.start()
        assert entered.wait(timeout=60)
        before = spillway.memory_stats()["spillway.num_spills"]
        a = (x * 2).exp().sum()  # outside any block: the process-wide min_bytes of 1 MiB
        b = (x * 3).exp().sum()  # (eager spills exp's 4 MiB output of a at this save)
        print("spills", spillway.memory_stats()["spillway.num_spills"] - before)
        finish.set()
        thread.join()
        (a + b).backward()
    """, env={"PYTHONUSERBASE": test_environment.SITE,
              "SPILLWAY_ALLOC_CONF":
                  "device:sim,capacity_mb:256,offload:eager,offload_min_kb:1024"})
    assert out.returncode == 0, out.stderr
    assert "spills 1" in out.stdout, out.stdout


@pytest.mark.skipif(test_environment.SITE is None, reason="SPILLWAY_PYTHON_SITE not set")
def test_the_last_block_to_end_on_any_thread_puts_the_process_wide_settings_back():
    """Review: under the environment hook, blocks of two threads that end in another order than
    they began left the settings of a block long ended in force (each end put back what its block
    found at its start): here the main thread's "eager" for good, where "auto" belongs."""
    out = test_environment.run_script("""
        import threading, spillway
        entered, finish = threading.Event(), threading.Event()
        def other_thread():
            with spillway.offload("off"):  # found the main thread's "eager" block at its start
                entered.set()
                finish.wait(timeout=60)
        block = spillway.offload("eager")
        block.__enter__()
        thread = threading.Thread(target=other_thread)
        thread.start()
        assert entered.wait(timeout=60)
        block.__exit__(None, None, None)  # ends first
        finish.set()
        thread.join()
        print("policy", spillway._C.offload_config()["policy"])
    """, env={"PYTHONUSERBASE": test_environment.SITE,
              "SPILLWAY_ALLOC_CONF": "device:sim,capacity_mb:256,offload:auto"})
    assert out.returncode == 0, out.stderr
    assert "policy auto" in out.stdout, out.stdout


def test_empty_cache_gives_pinned_host_memory_back():
    out = run_script("""
        import torch, spillway
        spillway.install("sim", capacity_bytes=256 << 20)
        x = torch.randn(1024, 1024, requires_grad=True)
        with spillway.offload("eager"):
            loss = (x * 2).exp().sum()
        spillway.synchronize()
        loss.backward()
        stats = spillway.memory_stats()
        print("spilled", stats["spillway.num_spills"],
              "cached", stats["spillway.host_reserved_bytes"] > 0)
        spillway.empty_cache()
        print("after", spillway.memory_stats()["spillway.host_reserved_bytes"])
    """)
    assert out.returncode == 0, out.stderr
    assert "spilled 1 cached True" in out.stdout, out.stdout
    assert "after 0" in out.stdout, out.stdout


def test_saves_keep_the_minimum_size_of_their_block():
    """A save below the enclosing block's min_bytes, made in an inner block that spills
    everything, is spilled by the enclosing block too: it keeps its own block's minimum."""
    x = torch.randn(256, 256, requires_grad=True)  # 256 KiB: below the default 1 MiB

    def forward():
        with spillway.offload("eager"):
            with spillway.offload("off", min_bytes=0):
                pass
            with spillway.offload("auto", min_bytes=0, budget_bytes=1 << 40):  # never spills
                loss = x.exp().sum()  # saves exp's output, 256 KiB, and nothing else
        loss.backward()

    assert spills_during(forward) == 1


def test_a_block_exited_without_being_entered_here_says_so():
    """Python review: a block exited twice, or on another thread than the one that entered it,
    raised a bare IndexError (pop from empty list)."""
    block = spillway.offload("off")
    with pytest.raises(RuntimeError, match="exited without being entered on this thread"):
        block.__exit__(None, None, None)
    block.__enter__()
    errors = []

    def exit_elsewhere():
        try:
            block.__exit__(None, None, None)
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=exit_elsewhere)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "same thread" in errors[0], errors
    block.__exit__(None, None, None)  # the entering thread closes it: nothing is left open
    with pytest.raises(RuntimeError, match="exited without being entered"):
        block.__exit__(None, None, None)


def test_blocks_exited_out_of_order_are_refused_and_change_nothing():
    """Helper review: blocks entered and exited by hand, out of order, put back the wrong
    settings (and popped each other's saved-tensor hooks)."""
    outer = spillway.offload("eager", min_bytes=0)
    inner = spillway.offload("off", min_bytes=0)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="exit the inner one first"):
        outer.__exit__(None, None, None)
    assert spillway._C.offload_config()["policy"] == "off"  # still the inner block's
    inner.__exit__(None, None, None)
    assert spillway._C.offload_config()["policy"] == "eager"  # the outer block's, back
    outer.__exit__(None, None, None)


def test_a_block_that_fails_to_begin_leaves_the_settings_as_they_were(monkeypatch):
    """Hooks review: a block whose saved-tensor hooks could not be pushed (torch refuses them
    inside disable_saved_tensors_hooks) left its own settings in force."""
    class Refused:
        def __init__(self, pack, unpack):
            pass

        def __enter__(self):
            raise RuntimeError("saved tensors hooks are disabled here")

    before = spillway._C.offload_config()
    monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks", Refused)
    with pytest.raises(RuntimeError, match="disabled here"):
        with spillway.offload("eager" if before["policy"] != "eager" else "off", min_bytes=7):
            pass
    assert spillway._C.offload_config() == before
