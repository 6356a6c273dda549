"""Generated gRPC stubs of the job service (proto/switchagg/jobs.proto); see proto/generate.sh."""
