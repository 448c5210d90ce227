"""The pure part of moving a recorded graph's pointers (xform.graph_pointers): which argument words
point into which span, which allocations make a span unsafe to move, and the moved values."""

from xform.graph_pointers import Pointer, Span, find_pointers, moved_values, overlapping, widened


def test_words_inside_a_span_are_found_and_words_at_its_end_are_not():
    spans = [Span(5000, 6000), Span(1000, 2000)]
    words = [[1000, 1999, 2000, 7], [5500, 999, 6000]]
    assert find_pointers(words, spans) == [Pointer(0, 0, 1000, 1), Pointer(0, 1, 1999, 1), Pointer(1, 0, 5500, 0)]


def test_an_allocation_overlapping_a_span_in_part_makes_it_unsafe_and_one_inside_does_not():
    span = Span(1000, 2000)
    inside, before, after, elsewhere = Span(1200, 1400), Span(500, 1100), Span(1900, 2600), Span(3000, 4000)
    assert overlapping([span, inside, elsewhere], span) == []
    assert overlapping([inside, before, after, elsewhere], span) == [before, after]


def test_moved_values_keep_each_words_offset_into_its_span():
    spans = [Span(1000, 2000), Span(5000, 6000)]
    pointers = [Pointer(0, 0, 1000, 0), Pointer(0, 3, 1256, 0), Pointer(2, 1, 5512, 1)]
    assert moved_values(pointers, [9000, 20000], spans) == {0: {0: 9000, 3: 9256}, 2: {1: 20512}}


def test_a_span_grows_over_allocations_overlapping_it_in_part_up_to_its_slack():
    span = Span(1000, 2000)
    chain = [Span(1800, 2500), Span(2400, 2600), Span(200, 1100), Span(5000, 6000)]
    assert widened(chain, span, slack=2000) == Span(200, 2600)  # the second grows over the first's growth
    assert widened(chain, span, slack=1000) is None
    assert widened([Span(1200, 1300)], span, slack=0) == span
