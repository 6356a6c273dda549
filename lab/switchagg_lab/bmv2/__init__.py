"""The bmv2 harness: frames on the testbed's wire, jobs installed on a real switch, the
controller against a real switch, and the workers the bmv2 suite runs."""
