"""switchagg's control plane: P4Runtime programming, the job service and switchagg-ctl."""
