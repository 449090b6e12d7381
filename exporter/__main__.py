from edgelite_export.cli import main

raise SystemExit(main())
