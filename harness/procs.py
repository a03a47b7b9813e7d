from harness.launch import children, dies_with_parent, finish, free_port, kill_node, start, workers  # noqa
