"""``md.exercise``: a lecture's check cell says "not done yet" for a stub and lets a wrong answer through;
``md.switched_off``: the library's version of an exercise raises while the student's runs."""

import pytest

import minidist as md
from exercise_workers import unsolved, wrong
from minidist import memory
from minidist.memory import activation_bytes_per_layer as imported  # a second name, as a notebook might
from minidist.memory import per_rank


def test_a_body_that_runs_to_the_end_is_correct(capsys):
    with md.exercise("Try it 1") as ex:
        assert 1 + 1 == 2
    assert ex.solved is True
    assert capsys.readouterr().out == "Try it 1: correct\n"


def test_a_stub_is_not_done_yet_and_the_notebook_goes_on(capsys):
    def student():
        raise NotImplementedError("TODO(Try it 2): write it")

    with md.exercise("Try it 2") as ex:
        student()
        raise AssertionError("not reached")
    assert ex.solved is False
    assert capsys.readouterr().out.startswith("Try it 2: not done yet -- write the function above")


def test_a_stub_inside_a_helper_that_wraps_the_error_is_still_not_done_yet(capsys):
    def student():
        raise NotImplementedError

    with md.exercise("Try it 3"):
        try:
            student()
        except NotImplementedError as error:
            raise RuntimeError("the bench could not run") from error
    assert "not done yet" in capsys.readouterr().out


def test_a_stub_in_a_launched_rank_is_not_done_yet(capsys):
    with md.exercise("Try it 4") as ex:
        md.launch(unsolved, 2, timeout=60)
    assert ex.solved is False
    assert "Try it 4: not done yet" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["here", "in a rank"])
def test_a_wrong_answer_stops_with_its_own_error(capsys, where):
    error = AssertionError if where == "here" else md.WorkerError
    with pytest.raises(error) as raised, md.exercise("Try it 5") as ex:
        if where == "here":
            raise AssertionError("got 3, expected 4")
        md.launch(wrong, 2, timeout=60)
    assert ex.solved is False
    assert capsys.readouterr().out == ""
    assert ("got 3" if where == "here" else "shapes differ") in str(raised.value)


def test_switched_off_reaches_every_name_of_a_function_and_restores_it():
    want = memory.activation_bytes_per_layer(16, 1, 8, 2)
    with md.switched_off("Try it 1", memory.activation_bytes_per_layer):
        for call in (memory.activation_bytes_per_layer, imported, per_rank.activation_bytes_per_layer):
            with pytest.raises(AssertionError, match="Try it 1 asks you to write it; the library's"):
                call(16, 1, 8, 2)
    assert imported(16, 1, 8, 2) == memory.activation_bytes_per_layer(16, 1, 8, 2) == want


def test_switched_off_a_class_and_a_method():
    class Layer:
        def __init__(self, k):
            self.k = k

        def forward(self, x):
            return self.k * x

    layer = Layer(2)
    with md.switched_off("Try it 3", Layer, (Layer, "forward")):
        with pytest.raises(AssertionError, match="Layer is switched off"):
            Layer(3)
        with pytest.raises(AssertionError, match=r"Layer\.forward is switched off"):
            Layer.forward(layer, 1)
    assert Layer(3).forward(2) == 6
