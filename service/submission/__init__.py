"""What a job request is checked against before it is stored: its handles resolved to URIs, the tenant's storage
policy, its objects in storage, the images its data rows name, submission limits, the memory plan; then the stored
row (create.py)."""
