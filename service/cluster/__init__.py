"""What the control plane asks of the Ray cluster: the scheduler loop (submit, follow, stop Ray jobs), the Ray Jobs
API calls (ray.job_submission's client, nothing of Ray's runtime), whether the cluster can place a job's workers, and
Serve deployments through Ray's Serve REST API."""
