"""Transactional first: the pure yield decisions (`yield_policy`), reading a group's lag from the
cluster (`reader`) and the lag monitor that publishes it (`monitor`)."""
