from jaxlab.grade.report import in_notebook_order


def test_per_question_table_lists_questions_in_notebook_order_not_alphabetical():
    otter_order = ["q10_dp_training", "q1_vmap_collective", "q2_global_sum", "q9_loss_tp"]
    assert in_notebook_order(otter_order) == [
        "q1_vmap_collective", "q2_global_sum", "q9_loss_tp", "q10_dp_training"]
