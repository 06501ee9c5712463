from trainaccel.cli import main

raise SystemExit(main())
