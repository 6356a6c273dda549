"""The lab: the emulated rack (testbed/), the shared test kit (testing/) and the bmv2 harness.

Above both products: it imports the worker library (switchagg) and the controller
(switchagg_controller); neither imports it. Training jobs never load it.
"""
